"""The spool's two tiers (memory first, disk when memory is full), a wiped memory tier, leaked temp files."""

from __future__ import annotations

import shutil
import time

import torch

from hsx.batch import batchfile
from hsx.life import heartbeat, ledger, queues
from hsx.monitor.progress import run_progress
from hsx.runspec import spool
from hsx.store import open_store
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import produce_config, upload_config, worker_config


def _upload_tiers(r, host="testhost") -> list[str]:
    q = queues.queue(r, queues.upload_queue_name(host))
    return [q.fetch_job(job_id).kwargs["tier"] for job_id in q.get_job_ids()]


def test_tier_choice_spills_to_disk_and_comes_back(tmp_path):
    tiers = spool.SpoolTiers.of(tmp_path / "disk", 100, tmp_path / "mem", 50)
    assert [t.name for t in tiers.tiers] == ["memory", "disk"]
    assert tiers.choose(40).name == "memory"
    (tmp_path / "mem" / "run").mkdir(parents=True)
    (tmp_path / "mem" / "run" / "b1.safetensors").write_bytes(b"x" * 50)
    assert tiers.choose(40).name == "disk"          # memory full: spill
    (tmp_path / "disk" / "run").mkdir(parents=True)
    (tmp_path / "disk" / "run" / "b2.safetensors.tmp-w").write_bytes(b"x" * 100)  # temp files count
    assert tiers.choose(40) is None and tiers.full()
    (tmp_path / "mem" / "run" / "b1.safetensors").unlink()
    assert tiers.choose(40).name == "memory"        # and back once uploads free memory
    assert spool.spool_usage(tmp_path / "disk") == spool.SpoolUsage(files=0, bytes=100, temp_files=1, temp_bytes=100)


def test_worker_fills_memory_then_disk_then_memory_again(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    mem, disk = tmp_path / "mem", tmp_path / "disk"
    for run in ("tiers1", "tiers2"):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=run))
        # memory budget of one byte: the (empty) memory tier takes one batch file, the rest spill to disk
        run_worker(worker_config(redis_server.url, disk, run=run, memory_spool_dir=mem, memory_spool_budget_bytes=1))
        batches = ledger.run_totals(r, run)["batches"]
        assert batches >= 3
        assert sorted(_upload_tiers(r)) == ["disk"] * (batches - 1) + ["memory"]
        assert len(spool.spool_files(mem, run)) == 1 and len(spool.spool_files(disk, run)) == batches - 1
        run_uploader(upload_config(redis_server.url, disk, memory_spool_dir=mem))
        assert run_progress(r, run)["complete"]
        assert spool.spool_usage(mem).bytes == 0 and spool.spool_usage(disk).bytes == 0
        assert verify_run(r, open_store(str(tmp_path / "store")), run).ok


def test_upload_job_path_must_be_its_tiers_file(r, redis_server, tiny_model, tmp_path):
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="conf", enqueue=False))
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"keep me")
    queues.enqueue_upload(r, "testhost", "conf", "b0000000", str(outside), 7, "0" * 64, tier="memory", seq=1)
    run_uploader(upload_config(redis_server.url, tmp_path / "disk", memory_spool_dir=tmp_path / "mem"))
    assert outside.read_bytes() == b"keep me" and not ledger.is_done(r, "conf", "b0000000")


def test_wiped_memory_tier_loses_nothing(r, redis_server, tiny_model, tmp_path):
    """A host crash takes the memory tier with it: batches spooled there are not done, so they are extracted
    again; the run completes with every sample exactly once."""
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    mem, disk = tmp_path / "mem", tmp_path / "disk"
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="wipe"))
    run_worker(worker_config(redis_server.url, disk, run="wipe", memory_spool_dir=mem, memory_spool_budget_bytes=2**30))
    batches = ledger.run_totals(r, "wipe")["batches"]
    assert len(spool.spool_files(mem, "wipe")) == batches and not ledger.done_count(r, "wipe")
    shutil.rmtree(mem)  # the host went down: tmpfs is empty after the reboot; Redis still holds the upload jobs
    run_uploader(upload_config(redis_server.url, disk, memory_spool_dir=mem))  # each job finds its file gone
    assert len(queues.queue(r, queues.extract_queue_name("wipe"))) == batches  # re-enqueued, nothing done
    run_worker(worker_config(redis_server.url, disk, run="wipe", worker_name="gpu-after-reboot",
                             memory_spool_dir=mem, memory_spool_budget_bytes=2**30))
    run_uploader(upload_config(redis_server.url, disk, memory_spool_dir=mem))
    p = run_progress(r, "wipe")
    assert p["complete"] and not p["dead_letters"]
    report = verify_run(r, open_store(str(tmp_path / "store")), "wipe")
    assert report.ok and not report.duplicate_samples and report.samples == p["totals"]["samples"]


def test_temp_file_of_a_writer_that_died_just_before_a_restart_is_swept(r, redis_server, tiny_model, tmp_path):
    """Issue 13 item 7: the dead writer's heartbeat key outlives it by up to 6 beats, so the restart's
    recovery keeps its temp file; a later sweep (on the heartbeat) removes it, and usage counts it meanwhile."""
    from gpu_worker.worker import load_runtime

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="leak", enqueue=False))
    spool_run = tmp_path / "spool" / "leak"
    spool_run.mkdir(parents=True)
    leaked = spool_run / "b0000001.safetensors.tmp-gpu-crashed-1"
    leaked.write_bytes(b"x" * 4096)
    heartbeat.publish_heartbeat(r, "leak", "gpu-crashed-1", {"host": "testhost"}, ttl_seconds=1)
    rt = load_runtime(worker_config(redis_server.url, tmp_path / "spool", run="leak"))
    try:
        rt.recovery.recover()
        assert leaked.exists()                                  # its writer still looked alive
        assert rt.stats()["spool_bytes"] == 4096                # but its bytes count against the budget
        time.sleep(1.5)                                         # the dead writer's heartbeat key expires
        for _ in range(6):                                      # one heartbeat TTL of beats later...
            rt.beat()
        assert not leaked.exists()                              # ...the sweep removed it
        assert rt.stats()["spool_bytes"] == 0
    finally:
        rt.prefetcher.close()


def test_fp8_quantise_round_trip_and_error_measure():
    from hsx.batch.dtypes import dequantise_fp8, fp8_error, quantise_fp8

    x = torch.randn(257, 3 * 64) * torch.logspace(-2, 2, 257)[:, None]  # per-token scales over 4 decades
    x[:, 64:128] *= 50                                                      # and one loud layer
    q, scales = quantise_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (257, 3)
    deq = dequantise_fp8(q, scales, torch.float32)
    err = fp8_error(x, q, scales)
    for layer in range(3):
        block = slice(layer * 64, (layer + 1) * 64)
        rel = float((deq[:, block] - x[:, block]).norm() / x[:, block].norm())
        assert abs(rel - float(err[0, layer])) < 1e-6 and rel < 0.05
        assert float(err[1, layer]) > 0.998
    zero = torch.zeros(4, 64)
    q0, s0 = quantise_fp8(zero, 1)
    assert torch.equal(dequantise_fp8(q0, s0, torch.float32), zero)


def test_codec_round_trip_is_exact():
    from hsx.batch import codec

    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        t = torch.randn(300, 96).to(dtype)
        enc, planes = codec.encode(t, "zstd")
        assert len(planes) == t.element_size()
        back = codec.decode(enc, "zstd", dtype, (300, 96), planes=planes)
        assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    assert planes == [["zstd", enc.numel()]]  # FP8 of randn: its one plane compresses
    try:
        codec.decode(enc[:-3], "zstd", torch.float8_e4m3fn, (300, 96), planes=[["zstd", enc.numel() - 3]])
    except ValueError as exc:
        assert "zstd" in str(exc)
    else:
        raise AssertionError("a truncated frame decoded")
    tensors = {"hidden_states": torch.randn(5, 8).bfloat16(), "input_ids": torch.arange(5, dtype=torch.int32),
               "loss_mask": torch.ones(5, dtype=torch.uint8), "cu_seqlens": torch.tensor([0, 2, 5])}
    data = batchfile.batch_bytes(tensors, {"format": batchfile.FORMAT, "sample_ids": '["a","b"]', "dtype": "bfloat16",
                                        "layer_ids": "[0]", "hidden_size": "8"}, codec="zstd")
    assert torch.equal(batchfile.read_batch_bytes(data).hidden_states, tensors["hidden_states"])


def test_worker_warns_with_both_rates_when_the_disk_cannot_keep_up(monkeypatch):
    from gpu_worker import writer

    clock = {"t": 100.0}
    monkeypatch.setattr(writer.time, "monotonic", lambda: clock["t"])
    rates = writer.WriteRates()
    rates.emitted(0)
    clock["t"] += 10.0
    rates.emitted(20 * 2**30)                       # the GPU emitted 2 GiB/s over 10 s
    rates.wrote("memory", 2**30, 0.1)               # the memory tier is fast: never the complaint
    assert rates.advice(threads=2) is None
    rates.wrote("disk", 2**30, 4.0)                 # 1 GiB in 4 s on each of 2 threads: 0.5 GiB/s
    advice = rates.advice(threads=2)
    assert "0.50 GiB/s" in advice and "2.00 GiB/s" in advice and "--memory-spool-budget-gb" in advice
    assert rates.advice(threads=2) is None          # at most one warning a minute
