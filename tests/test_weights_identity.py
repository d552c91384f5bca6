"""Issue 29 item 4: two models in one run. Before: `hsx produce` on an existing run with another checkpoint of
the same config was accepted and the manifest's model path switched (the identity held the config hash, nothing of
the weights). The weights are now fingerprinted (hsx/prep/weights.py) into the run's identity.

Issue 37 item 4: that fingerprint sampled two 1 KiB windows a tensor, so a checkpoint changed elsewhere in a
tensor passed as the same model, and on resume the model path switched to it silently. It now covers every byte
(BLAKE3), is cached beside the checkpoint by size, mtime and ctime, runs an older hsx planned (``sampled-v1``)
still resume and are compared in their scheme, and a changed model path on resume is said in one line."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from gpu_worker.worker import WorkerSetupError, load_runtime
from hsx import life
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.prep import sampledweights, weights
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
    assert first.model_weights.startswith("blake3-v1:")
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


def _patch_rows_of_the_embedding(folder, rows: int = 3) -> None:
    """The last ``rows`` rows of the embedding changed (as added tokens would be), away from the two windows
    the sampled fingerprint read; size and mtime kept (the ctime moves: no one can set it back)."""
    [shard] = weights.weight_files(folder)
    stat = shard.stat()
    raw = bytearray(shard.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    entry = header["model.embed_tokens.weight"]
    start, end = entry["data_offsets"]
    row = (end - start) // entry["shape"][0]
    assert end - start > 3 * sampledweights.WINDOW and rows * row < (end - start) // 2 - sampledweights.WINDOW
    for i in range(8 + header_len + end - rows * row, 8 + header_len + end):
        raw[i] ^= 0x01
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_tensor_changed_away_from_the_sampled_windows_is_another_checkpoint(r, redis_server, tiny_model,
                                                                              tmp_path, rows, caplog):
    store = str(tmp_path / "store")
    first = produce(produce_config(redis_server.url, tiny_model, store, run="rows", dataset=rows)).manifest
    patched = shutil.copytree(tiny_model, tmp_path / "patched", ignore=shutil.ignore_patterns(".hsx-*"))
    assert weights_fingerprint(str(patched)) == first.model_weights   # the place does not count
    _patch_rows_of_the_embedding(patched)
    files = weights.weight_files(patched)
    assert sampledweights.sampled_fingerprint(files) == sampledweights.sampled_fingerprint(
        weights.weight_files(tiny_model))   # what the old scheme missed
    assert weights_fingerprint(str(patched)) != first.model_weights
    with pytest.raises(ManifestMismatch, match="another checkpoint"):
        produce(produce_config(redis_server.url, patched, store, run="rows", dataset=rows))
    assert ledger.get_manifest(r, "rows").model == str(tiny_model)   # the run's model did not switch
    # The same weights in another folder: the run resumes, and the new path is said in one line.
    copy = shutil.copytree(tiny_model, tmp_path / "moved")
    caplog.set_level(logging.WARNING)
    produce(produce_config(redis_server.url, copy, store, run="rows", dataset=rows))
    said = [rec.getMessage() for rec in caplog.records if "model path changes" in rec.getMessage()]
    assert said == [f"run rows: its model path changes from {tiny_model} to {copy} (same config, the same weights "
                    "fingerprint)"]


def test_the_fingerprint_is_cached_by_size_mtime_and_ctime(tiny_model, tmp_path, monkeypatch):
    copy = shutil.copytree(tiny_model, tmp_path / "copy", ignore=shutil.ignore_patterns(".hsx-*"))
    truth = weights_fingerprint(str(copy))
    cache_file = copy / weights.CACHE_NAME
    cached = json.loads(cache_file.read_text())
    [shard] = weights.weight_files(copy)
    assert cached["files"][shard.name]["size"] == shard.stat().st_size
    # The cache is read (a forged entry shows through while the file's stat is unchanged) ...
    cached["files"][shard.name]["blake3"] = "0" * 64
    cache_file.write_text(json.dumps(cached))
    assert weights_fingerprint(str(copy)) != truth
    # ... and is not trusted once the file changed: a touch moves mtime and ctime, the bytes are read again.
    os.utime(shard)
    assert weights_fingerprint(str(copy)) == truth
    # A folder it cannot write the cache into: cached under the user's cache dir instead.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache_file.unlink()
    cache_file.mkdir()   # the name is taken by a folder: the cache cannot be written beside the weights
    os.utime(shard)
    assert weights_fingerprint(str(copy)) == truth
    [private] = (tmp_path / "xdg" / "hsx" / "weights").glob("*.json")
    assert json.loads(private.read_text())["files"][shard.name]["blake3"] != "0" * 64


def test_a_run_an_older_hsx_planned_resumes_in_its_scheme(r, redis_server, tiny_model, other_checkpoint, tmp_path,
                                                          rows):
    """A manifest with a ``sampled-v1`` fingerprint: `hsx produce` resumes it and keeps it (its identity); the
    first worker records the full fingerprint beside it, and another checkpoint is refused by both."""
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="v1", dataset=rows))
    legacy = sampledweights.sampled_fingerprint(weights.weight_files(tiny_model))
    for raw, put in ((r.get(RunKeys("v1").manifest), lambda b: r.set(RunKeys("v1").manifest, b)),
                     ((store_dir / layout.manifest_key("v1")).read_bytes(),
                      (store_dir / layout.manifest_key("v1")).write_bytes)):
        put(json.dumps({**json.loads(raw), "model_weights": legacy}).encode())
    resumed = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="v1", dataset=rows)).manifest
    assert resumed.model_weights == legacy == ledger.get_manifest(r, "v1").model_weights
    load_runtime(worker_config(redis_server.url, tmp_path / "s1", run="v1")).close()
    assert life.Run(r, "v1").recorded_weights()["fingerprint"] == weights_fingerprint(str(tiny_model))
    with pytest.raises(ManifestMismatch, match="another checkpoint"):
        produce(produce_config(redis_server.url, other_checkpoint, str(store_dir), run="v1", dataset=rows))
    with pytest.raises(WorkerSetupError, match="another checkpoint"):
        load_runtime(worker_config(redis_server.url, tmp_path / "s2", run="v1", model_override=str(other_checkpoint)))
