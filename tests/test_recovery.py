"""Recovery paths in-process: verify/repair, dead letters, duplicates, leases, disk full, NaN."""

import json
import time

import pytest
import torch

from hsx.life import batchlife, leases, ledger, queues
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress
from hsx.store import layout, open_store
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import planned_specs, produce_config, run_pipeline, upload_config, worker_config


def _counters(r, run):
    return ledger.run_totals(r, run), run_progress(r, run)["done"]


def test_verify_finds_gaps_and_repair_reextracts_them(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from hsx_reader import RunDataset
    from hsx_reader.objects import CorruptBatch
    from uploader.worker import run_uploader

    store_dir = tmp_path / "store"
    run_pipeline(redis_server.url, tiny_model, str(store_dir), tmp_path / "spool", run="vr")
    store = open_store(str(store_dir))
    report = verify_run(r, store, "vr")
    assert report.ok and report.checked == report.planned and report.samples == 160
    specs = ledger.all_specs(r, "vr")
    lost, bad = specs["b0000001"], specs["b0000002"]
    store.delete(layout.batch_key("vr", lost.shard, lost.batch_id))
    path = store_dir / layout.batch_key("vr", bad.shard, bad.batch_id)
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # first byte of hidden_states (the first tensor)
    data[start:start + 64] = bytes(64)                # same size, still decodes: zeros where hidden states were
    path.write_bytes(bytes(data))
    # The reader checks each whole object against the index's SHA-256: no silent zeros.
    ds = RunDataset(str(store_dir), "vr")
    row = next(i for i, ref in enumerate(ds.index.samples) if ref.batch_id == "b0000002")
    with pytest.raises(CorruptBatch, match="SHA-256"):
        ds[row]
    report = verify_run(r, store, "vr")
    assert not report.ok and set(report.problems) == {"b0000001", "b0000002"}
    assert "missing from the store" in report.problems["b0000001"]
    assert "different SHA-256" in report.problems["b0000002"]
    quick = verify_run(r, store, "vr", quick=True)
    assert set(quick.problems) == {"b0000001"}  # sizes only: the same-size corruption needs the full check
    # `hsx verify --repair`: both bad batches leave the ledger and are extracted again, nothing by hand.
    repaired = verify_run(r, store, "vr", repair=True)
    assert repaired.repaired == ["b0000001", "b0000002"] and not path.exists()
    assert queues.pending_extract(r, "vr") == {"b0000001", "b0000002"}
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="vr"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    assert verify_run(r, store, "vr").ok
    totals, done = _counters(r, "vr")
    assert done["batches"] == totals["batches"] and done["samples"] == totals["samples"] == 160
    ds = RunDataset(str(store_dir), "vr")  # the index was written again, with the new objects' digests
    assert ds[row]["sample_id"] == ds.index.samples[row].sample_id


def test_corrupt_inputs_are_refused_then_rewritten_by_produce(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    store_dir = tmp_path / "store"
    cfg = produce_config(redis_server.url, tiny_model, str(store_dir), run="ci", max_attempts=2)
    produce(cfg)
    spec = ledger.get_spec(r, "ci", "b0000001")
    inputs = store_dir / layout.input_key("ci", spec.shard, spec.batch_id)
    data = bytearray(inputs.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    lo = json.loads(data[8:8 + header_len])["loss_mask"]["data_offsets"][0]
    data[8 + header_len + lo] ^= 0x01  # one bit of the loss mask: same size, still decodes, still runs
    inputs.write_bytes(bytes(data))
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="ci"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    dead = ledger.dead_letters(r, "ci")
    assert list(dead) == ["b0000001"] and "differ from the SHA-256 the producer recorded" in dead["b0000001"]["last_error"]
    produce(cfg)  # re-run: the input object is rewritten (its bytes differ from the plan's)
    assert batchlife.retry(r, "ci") == ["b0000001"]
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="ci"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    assert run_progress(r, "ci")["complete"] and verify_run(r, open_store(str(store_dir)), "ci").ok


def test_retry_failed_batch_on_a_done_batch_says_why_and_points_at_repair(r, redis_server, redis_env, tiny_model,
                                                                            tmp_path):
    from tests.test_cli import hsx

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rf", enqueue=False))
    ledger.mark_done(r, "rf", ledger.get_spec(r, "rf", "b0000000"), "k", 1, "0" * 64, by="test")
    out = hsx("retry-failed", "--run", "rf", "--batch", "b0000000")
    assert out.returncode == 2 and "re-enqueued" not in out.stdout
    assert "b0000000 (done)" in out.stderr and "hsx verify --run rf --repair" in out.stderr
    assert queues.pending_extract(r, "rf") == set()


def test_bad_batch_goes_to_dead_letters_then_retry_failed(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    store_dir = tmp_path / "store"
    cfg = produce_config(redis_server.url, tiny_model, str(store_dir), run="dl", max_attempts=3)
    produce(cfg)
    spec = ledger.get_spec(r, "dl", "b0000003")
    inputs = store_dir / layout.input_key("dl", spec.shard, spec.batch_id)
    good = inputs.read_bytes()
    inputs.write_bytes(good[: len(good) // 2])  # truncated input object: every attempt raises
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="dl"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    dead = ledger.dead_letters(r, "dl")
    assert list(dead) == ["b0000003"] and dead["b0000003"]["attempts"] == 3
    # The digest is checked before decoding: a truncated object is named as bytes that differ from the plan's.
    assert "differ from the SHA-256 the producer recorded" in dead["b0000003"]["last_error"]
    assert "b0000003" in dead["b0000003"]["last_error"]
    p = run_progress(r, "dl")
    assert p["done"]["batches"] == p["totals"]["batches"] - 1  # the rest of the run went on
    inputs.write_bytes(good)
    assert batchlife.retry(r, "dl") == ["b0000003"]
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="dl"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    assert run_progress(r, "dl")["complete"] and not ledger.dead_letters(r, "dl")


def test_duplicate_delivery_counts_once(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    store_dir = tmp_path / "store"
    run_pipeline(redis_server.url, tiny_model, str(store_dir), tmp_path / "spool", run="dup")
    before = run_progress(r, "dup")["done"]
    # The same batch delivered again, to the worker and to the uploader.
    dup_job = queues.enqueue_extract(r, "dup", "b0000000", seq=77)
    spec = ledger.get_spec(r, "dup", "b0000000")
    key = layout.batch_key("dup", spec.shard, spec.batch_id)
    stored = (store_dir / key).read_bytes()
    spool_copy = tmp_path / "spool" / "dup" / "b0000000.safetensors"
    spool_copy.write_bytes(stored)
    info = ledger.done_record(r, "dup", "b0000000")
    queues.enqueue_upload(r, "testhost", "dup", "b0000000", str(spool_copy), info["size"], info["sha256"], seq=78)
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="dup"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    assert run_progress(r, "dup")["done"] == before
    # The duplicate ran and did nothing; rq kept nothing of it (life.RESULT_TTL is 0: the ledger says what finished).
    assert not r.exists(dup_job.key) and not r.exists(f"rq:results:{dup_job.id}")
    assert queues.queue(r, queues.extract_queue_name("dup")).count == 0
    assert (store_dir / key).read_bytes() == stored
    assert not spool_copy.exists()
    assert verify_run(r, open_store(str(store_dir)), "dup").ok
    # mark_done itself is idempotent
    assert ledger.mark_done(r, "dup", spec, key, info["size"], info["sha256"], by="again") is False


def test_leases_use_redis_clock_not_the_hosts(r, redis_server, tiny_model, tmp_path, monkeypatch):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="clk", enqueue=False))
    keys = RunKeys("clk")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 120)  # this host's clock runs 2 minutes ahead
    leases.take(r, keys.extract_leases, "b0000001", lease_seconds=5)
    leases.refresh(r, keys.extract_leases, ["b0000001", "b0000009"], lease_seconds=5)  # never resurrects b0000009
    expiry, now = r.zscore(keys.extract_leases, "b0000001"), leases.redis_now(r)
    assert now + 4 <= expiry <= now + 6 and r.zscore(keys.extract_leases, "b0000009") is None
    assert batchlife.reap(r, "clk", max_attempts=3)["extract"] == []  # a skewed reaper does not take a live lease
    monkeypatch.setattr(time, "time", lambda: real() - 120)  # ...nor does a clock running behind hold a dead one
    leases.take(r, keys.extract_leases, "b0000002", lease_seconds=0)
    assert batchlife.reap(r, "clk", max_attempts=3)["extract"] == ["b0000002"]


def test_expired_lease_is_reclaimed_once(r, redis_server, tiny_model, tmp_path):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="lease", enqueue=False))
    keys = RunKeys("lease")
    leases.take(r, keys.extract_leases, "b0000002", lease_seconds=0.01)
    leases.take(r, keys.extract_leases, "b0000003", lease_seconds=60)
    time.sleep(0.05)
    assert batchlife.reap(r, "lease", max_attempts=3)["extract"] == ["b0000002"]
    assert batchlife.reap(r, "lease", max_attempts=3)["extract"] == []
    assert queues.pending_extract(r, "lease") == {"b0000002", "b0000003"}
    assert ledger.failures(r, "lease")["b0000002"]["last_error"].startswith("worker lost")


def test_nan_hidden_states_never_land(r, redis_server, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from gpu_worker.worker import run_worker

    broken = tmp_path / "broken-model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    for f in tiny_model.iterdir():
        if f.is_file() and not (broken / f.name).exists():
            (broken / f.name).write_bytes(f.read_bytes())
    produce(produce_config(redis_server.url, broken, str(tmp_path / "store"), run="nan", max_attempts=2))
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="nan"))
    dead = ledger.dead_letters(r, "nan")
    assert len(dead) == ledger.run_totals(r, "nan")["batches"]
    assert all("NaN/Inf" in rec["last_error"] for rec in dead.values())
    assert not list((tmp_path / "spool").rglob("*.safetensors*"))
    assert len(queues.queue(r, queues.upload_queue_name("testhost"))) == 0


def test_disk_full_fails_cleanly_and_retries(r, redis_server, tiny_model, tmp_path, monkeypatch):
    from gpu_worker import writer as writer_mod
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="full"))
    real_write = writer_mod.write_atomic
    calls = {"n": 0}

    def flaky_disk(path, tensors, metadata, fsync=True, tmp_tag=None, codec="none"):
        calls["n"] += 1
        if calls["n"] in (1, 3):  # ENOSPC half-way through the file: the temp file must not survive
            tmp = path.with_name(f"{path.name}.tmp-{__import__('os').getpid()}")
            tmp.write_bytes(b"partial")
            tmp.unlink()
            raise OSError(28, "No space left on device")
        return real_write(path, tensors, metadata, fsync, tmp_tag, codec)

    monkeypatch.setattr(writer_mod, "write_atomic", flaky_disk)
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="full"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    p = run_progress(r, "full")
    assert calls["n"] == p["totals"]["batches"] + 2  # the two failed writes were retried, each batch written once
    assert p["complete"] and not p["dead_letters"]
    assert [f for f in (tmp_path / "spool").rglob("*") if f.is_file()] == []  # no partial or temp file left
    assert verify_run(r, open_store(str(tmp_path / "store")), "full").ok


def test_restart_cleans_dead_writers_temp_files_only(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import load_runtime
    from hsx.life import heartbeat

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rs", enqueue=False))
    spool_run = tmp_path / "spool" / "rs"
    spool_run.mkdir(parents=True)
    dead = spool_run / "b0000001.safetensors.tmp-gpu-dead-1"
    live = spool_run / "b0000002.safetensors.tmp-gpu-live-2"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    heartbeat.publish_heartbeat(r, "rs", "gpu-live-2", {"host": "testhost"}, ttl_seconds=30)
    # A complete file left from before the restart, not done, of this plan: its upload is enqueued again.
    # One of another incarnation of the run (reset since) is removed (issue 29 item 1).
    from hsx.batch import batchfile

    manifest = ledger.get_manifest(r, "rs")

    def batch_file(path, bid, incarnation):
        spec = planned_specs(r, "rs")[bid]   # its sample ids from the store (issue 42)
        n = len(spec.sample_ids)
        batchfile.write_atomic(path, {"hidden_states": torch.zeros(n, manifest.width, dtype=torch.float32),
                                      "input_ids": torch.zeros(n, dtype=torch.int32),
                                      "loss_mask": torch.zeros(n, dtype=torch.uint8),
                                      "cu_seqlens": torch.arange(n + 1)},
                               {"format": batchfile.FORMAT, "run": "rs", "batch_id": bid, "incarnation": incarnation,
                                "sample_ids": json.dumps(spec.sample_ids), "dtype": manifest.dtype,
                                "layer_ids": json.dumps(list(manifest.layer_ids)), "hidden_size": str(manifest.hidden_size)})
        return spec

    complete = spool_run / "b0000000.safetensors"
    spec = batch_file(complete, "b0000000", manifest.incarnation)
    foreign = spool_run / "b0000001.safetensors"
    batch_file(foreign, "b0000001", "f" * 32)
    rt = load_runtime(worker_config(redis_server.url, tmp_path / "spool", run="rs"))
    try:
        assert rt.recovery.recover() == 1
    finally:
        rt.prefetcher.close()
    assert not dead.exists() and live.exists() and complete.exists() and not foreign.exists()
    assert queues.pending_upload(r, "testhost", "rs") == {spec.batch_id}
