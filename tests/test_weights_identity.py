"""Issue 29 item 4: two models in one run. Before: `hsx produce` on an existing run with another checkpoint of
the same config was accepted and the manifest's model path switched (the identity held the config hash, nothing of
the weights). The weights are now fingerprinted (hsx/prep/weights.py) into the run's identity."""

from __future__ import annotations

import json
import shutil

import pytest

from gpu_worker.worker import WorkerSetupError, load_runtime
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.prep import weights
from hsx.prep.weights import weights_fingerprint
from hsx.runspec.manifest import Manifest, ManifestMismatch
from hsx.store import layout
from hsx_tools.demo import sample_dataset
from producer.produce import produce
from tests.pipeline import produce_config, worker_config


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:20]))
    return path


def test_another_checkpoint_of_the_same_config_is_refused_naming_both(r, redis_server, tiny_model, other_checkpoint,
                                                                      tmp_path, rows):
    store = str(tmp_path / "store")
    first = produce(produce_config(redis_server.url, tiny_model, store, run="two", dataset=rows)).manifest
    assert first.model_weights.startswith("sampled-v1:")
    with pytest.raises(ManifestMismatch) as caught:
        produce(produce_config(redis_server.url, other_checkpoint, store, run="two", dataset=rows))
    message = str(caught.value)
    theirs = weights_fingerprint(str(other_checkpoint))
    assert first.model_weights in message and theirs in message and theirs != first.model_weights
    assert str(tiny_model) in message and str(other_checkpoint) in message
    assert ledger.get_manifest(r, "two").model == str(tiny_model)   # the run's model did not switch
    # A worker handed the other checkpoint (--model) refuses before it takes a job, naming both.
    with pytest.raises(WorkerSetupError, match="another checkpoint") as refused:
        load_runtime(worker_config(redis_server.url, tmp_path / "spool", run="two", model_override=str(other_checkpoint)))
    assert first.model_weights in str(refused.value) and theirs in str(refused.value)


def test_a_manifest_without_a_fingerprint_resumes_and_records_it(r, redis_server, tiny_model, other_checkpoint,
                                                                 tmp_path, rows, caplog):
    """A run planned by an hsx that did not fingerprint: it resumes, and this call's fingerprint is recorded."""
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="old", dataset=rows))
    for raw, put in ((r.get(RunKeys("old").manifest), lambda b: r.set(RunKeys("old").manifest, b)),
                     ((store_dir / layout.manifest_key("old")).read_bytes(),
                      (store_dir / layout.manifest_key("old")).write_bytes)):
        data = json.loads(raw)
        del data["model_weights"], data["incarnation"]
        put(json.dumps(data).encode())
    assert ledger.get_manifest(r, "old").model_weights == ""
    resumed = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="old", dataset=rows)).manifest
    assert resumed.model_weights == weights_fingerprint(str(tiny_model)) == ledger.get_manifest(r, "old").model_weights
    assert resumed.incarnation == ""   # its batch files carry none: they stay this run's
    assert Manifest.load(open_local(store_dir), "old").model_weights == resumed.model_weights
    assert "did not fingerprint the weights" in caplog.text
    with pytest.raises(ManifestMismatch, match="another checkpoint"):
        produce(produce_config(redis_server.url, other_checkpoint, str(store_dir), run="old", dataset=rows))


def open_local(path):
    from hsx.store import open_store

    return open_store(str(path))


def test_the_fingerprint_reads_a_sample_and_sees_any_retrained_tensor(tiny_model, tmp_path, monkeypatch):
    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    assert weights_fingerprint(str(copy)) == weights_fingerprint(str(tiny_model))   # the place does not count
    [shard] = weights.weight_files(copy)
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    header = json.loads(shard.read_bytes()[8:8 + header_len])
    reads: list[int] = []
    real_pread = weights.os.pread
    monkeypatch.setattr(weights.os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    before = weights_fingerprint(str(copy))
    tensors = [name for name in header if name != "__metadata__"]
    assert sum(reads) <= 8 + header_len + 2 * weights.WINDOW * len(tensors) < shard.stat().st_size
    # One tensor changed where training changes it (all of it): another fingerprint. The last one, so no
    # other tensor's window covers it.
    name = max(tensors, key=lambda n: header[n]["data_offsets"][0])
    start, end = header[name]["data_offsets"]
    data = bytearray(shard.read_bytes())
    for i in range(8 + header_len + start, 8 + header_len + end):
        data[i] ^= 0x01
    shard.write_bytes(bytes(data))
    assert weights_fingerprint(str(copy)) != before
