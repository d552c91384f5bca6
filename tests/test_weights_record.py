"""Issue 37 item 3: a run planned where the producer has no weight files (a hub id not downloaded on its host)
had no fingerprint, and its workers checked nothing: two checkpoints of one config extracted into one run. Now
the first worker that loads weights records their fingerprint in Redis (hsx.life.Run.record_weights, SET NX), every
later worker compares its own and refuses naming both, `hsx produce` of the run takes the record into the
manifest, and the producer says at plan time, in one line, what follows. Also: the worker's ready line names
the folder it loaded (and the run's model where they differ)."""

from __future__ import annotations

import logging
import shutil

import pytest

from gpu_worker import worker as worker_module
from gpu_worker.worker import WorkerSetupError, load_runtime
from hsx import life
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.life.weightsrecord import WeightsRecordError
from hsx.prep import weights_fingerprint
from hsx.runspec.manifest import Manifest, ManifestMismatch
from hsx.store import open_store
from hsx_tools.demo import sample_dataset
from producer.produce import produce
from tests.pipeline import produce_config, worker_config


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:20]))
    return path


@pytest.fixture
def config_only(tiny_model, tmp_path):
    """The tiny model's config and tokenizer without its weights: what a producer host sees of a model it
    does not hold."""
    folder = shutil.copytree(tiny_model, tmp_path / "config-only",
                             ignore=shutil.ignore_patterns("*.safetensors", ".hsx-*"))
    assert not list(folder.glob("*.safetensors"))
    return folder


def test_a_run_planned_without_weights_takes_the_first_workers_and_refuses_another(
        r, redis_server, tiny_model, other_checkpoint, config_only, tmp_path, rows, caplog):
    store = str(tmp_path / "store")
    caplog.set_level(logging.INFO)
    planned = produce(produce_config(redis_server.url, config_only, store, run="nowts", dataset=rows)).manifest
    assert planned.model_weights == ""
    said = [rec.getMessage() for rec in caplog.records if "to fingerprint" in rec.getMessage()]
    assert len(said) == 1 and "the first worker that loads the weights records" in said[0], said
    assert str(config_only) in said[0]

    first = load_runtime(worker_config(redis_server.url, tmp_path / "s1", run="nowts", worker_name="w1",
                                       model_override=str(tiny_model)))
    first.close()
    ours = weights_fingerprint(str(tiny_model))
    # The manifest took it at once, in Redis and in the store (a producer need not run again).
    assert first.manifest.model_weights == ours == ledger.get_manifest(r, "nowts").model_weights
    assert Manifest.load(open_store(store), "nowts").model_weights == ours
    # Another checkpoint of the same config: refused before it takes a job, naming both fingerprints and models.
    with pytest.raises(WorkerSetupError, match="another checkpoint") as refused:
        load_runtime(worker_config(redis_server.url, tmp_path / "s3", run="nowts", worker_name="w3",
                                   model_override=str(other_checkpoint)))
    theirs = weights_fingerprint(str(other_checkpoint))
    message = str(refused.value)
    assert "\n" not in message and ours in message and theirs in message and theirs != ours
    assert str(other_checkpoint.resolve()) in message and str(config_only) in message
    held = life.Run(r, "nowts").recorded_weights()
    assert held["fingerprint"] == ours and held["worker"] == "w1" and held["model"] == str(tiny_model.resolve())
    # The same weights again: accepted, and the record is the first worker's still.
    again = load_runtime(worker_config(redis_server.url, tmp_path / "s2", run="nowts", worker_name="w2",
                                       model_override=str(tiny_model)))
    again.close()
    assert life.Run(r, "nowts").recorded_weights()["worker"] == "w1"

    # `hsx produce` of the run again keeps it ...
    resumed = produce(produce_config(redis_server.url, config_only, store, run="nowts", dataset=rows)).manifest
    assert resumed.model_weights == ours == ledger.get_manifest(r, "nowts").model_weights
    assert Manifest.load(open_store(store), "nowts").model_weights == ours
    # ... and a producer that has the other checkpoint is refused, naming both.
    with pytest.raises(ManifestMismatch) as mixed:
        produce(produce_config(redis_server.url, other_checkpoint, store, run="nowts", dataset=rows))
    assert ours in str(mixed.value) and theirs in str(mixed.value)


def test_the_record_is_first_writer_wins_and_needs_the_run(r, redis_server, tiny_model, tmp_path, rows):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rec", dataset=rows))
    held = life.Run(r, "rec").record_weights("blake3-v1:" + "a" * 64, "/m/a", "w1", "h1")
    assert held["fingerprint"] == "blake3-v1:" + "a" * 64
    later = life.Run(r, "rec").record_weights("blake3-v1:" + "b" * 64, "/m/b", "w2", "h2")
    assert later["fingerprint"] == "blake3-v1:" + "a" * 64 and later["worker"] == "w1"
    with pytest.raises(WeightsRecordError, match="no manifest"):
        life.Run(r, "gone").record_weights("blake3-v1:" + "a" * 64, "/m/a", "w1", "h1")
    r.set(RunKeys("rec").model_weights, "\x1b]0;pwned\x07")
    with pytest.raises(WeightsRecordError, match="not a weights record") as bad:
        life.Run(r, "rec").recorded_weights()
    assert "\x1b" not in str(bad.value)


def test_the_ready_line_names_the_folder_loaded_and_the_runs_model(r, redis_server, tiny_model, tmp_path, rows,
                                                                    caplog):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="ready", dataset=rows))
    copy = shutil.copytree(tiny_model, tmp_path / "copy-of-tiny")
    caplog.set_level(logging.INFO)
    rt = load_runtime(worker_config(redis_server.url, tmp_path / "spool", run="ready", model_override=str(copy)))
    rt.say_ready()
    rt.close()
    [ready] = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("ready:")]
    assert ready.startswith(f"ready: model {copy.resolve()} (the run's model: {tiny_model})"), ready


def test_a_manifest_rewritten_meanwhile_keeps_the_record_for_the_producer(r, redis_server, tiny_model, config_only,
                                                                          tmp_path, rows):
    """The record takes the manifest only if Redis still holds the manifest the worker read; otherwise the
    record alone holds the fingerprint, and the next `hsx produce` writes it into the manifest."""
    store = str(tmp_path / "store")
    produce(produce_config(redis_server.url, config_only, store, run="race", dataset=rows))
    read = ledger.get_manifest(r, "race")
    r.set(RunKeys("race").manifest, read.to_json(indent=1))   # the same manifest, other bytes: as another writer's
    held = life.Run(r, "race").record_weights("blake3-v1:" + "c" * 64, "/m/c", "w1", "h1", read)
    assert held["fingerprint"] == "blake3-v1:" + "c" * 64
    assert ledger.get_manifest(r, "race").model_weights == ""
    produce(produce_config(redis_server.url, config_only, store, run="race", dataset=rows))
    assert ledger.get_manifest(r, "race").model_weights == "blake3-v1:" + "c" * 64


def test_a_checkpoint_whose_fingerprint_is_cached_is_refused_before_it_loads(r, redis_server, tiny_model,
                                                                             other_checkpoint, tmp_path, rows,
                                                                             monkeypatch):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="early", dataset=rows))
    weights_fingerprint(str(other_checkpoint))   # its cache is current now: checking it reads nothing

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before its weights were checked")

    monkeypatch.setattr(worker_module.Extractor, "load", no_load)
    with pytest.raises(WorkerSetupError, match="another checkpoint"):
        load_runtime(worker_config(redis_server.url, tmp_path / "spool", run="early",
                                   model_override=str(other_checkpoint)))
