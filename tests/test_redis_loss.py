"""Redis lost a run (restarted empty): the store is the second copy of the truth; roles stop, not spin."""

import os
import struct
import subprocess
import sys
import time

from rq.job import Job

from hsx.life import ledger, queues
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress
from hsx.store import layout, open_store
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import produce_config, run_pipeline, upload_config, worker_config
from tests.waiting import scaled


def test_produce_rebuilds_the_ledger_from_the_store(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    store_dir, spool = tmp_path / "store", tmp_path / "spool"
    run_pipeline(redis_server.url, tiny_model, str(store_dir), spool, run="lr")
    specs = ledger.all_specs(r, "lr")
    total = len(specs)
    store = open_store(str(store_dir))
    # Redis restarted empty; meanwhile one object went missing and one was replaced by another batch's bytes.
    r.flushall()
    gone, wrong = specs["b0000001"], specs["b0000002"]
    store.delete(layout.batch_key("lr", gone.shard, gone.batch_id))
    other = (store_dir / layout.batch_key("lr", specs["b0000003"].shard, "b0000003")).read_bytes()
    (store_dir / layout.batch_key("lr", wrong.shard, wrong.batch_id)).write_bytes(other)
    again = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="lr"))
    assert again.rebuilt == total - 2 and again.enqueued == 2 and again.already_done == total - 2
    assert queues.pending_extract(r, "lr") == {"b0000001", "b0000002"}
    rt = run_worker(worker_config(redis_server.url, spool, run="lr"))
    assert rt.batches_run == 2  # only the two bad batches were computed again
    run_uploader(upload_config(redis_server.url, spool))
    assert run_progress(r, "lr")["complete"] and verify_run(r, store, "lr").ok
    assert run_progress(r, "lr")["done"]["samples"] == 160


def test_verify_rebuild_ledger_checks_objects_in_full(r, redis_server, tiny_model, tmp_path):
    store_dir = tmp_path / "store"
    run_pipeline(redis_server.url, tiny_model, str(store_dir), tmp_path / "spool", run="vl")
    specs = ledger.all_specs(r, "vl")
    for bid in ("b0000000", "b0000004"):
        ledger.unmark_done(r, "vl", specs[bid])
    path = store_dir / layout.batch_key("vl", specs["b0000004"].shard, "b0000004")
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # first hidden value (float32 in these tests)
    data[start:start + 4] = struct.pack("<f", float("nan"))  # the header still checks out; the data does not
    path.write_bytes(bytes(data))
    report = verify_run(r, open_store(str(store_dir)), "vl", rebuild=True)
    assert report.rebuilt == ["b0000000"]
    assert ledger.is_done(r, "vl", "b0000000") and not ledger.is_done(r, "vl", "b0000004")


def test_uploader_stops_on_a_vanished_run_and_keeps_the_file(r, redis_server, tiny_model, tmp_path):
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="uv", enqueue=False))
    spool_file = tmp_path / "spool" / "uv" / "b0000000.safetensors"
    spool_file.parent.mkdir(parents=True)
    spool_file.write_bytes(b"x" * 10)
    r.flushall()
    job = queues.enqueue_upload(r, "testhost", "uv", "b0000000", str(spool_file), 10, "0" * 64, seq=1)
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))  # burst: returns once the queue is empty
    assert "RunVanished" in Job.fetch(job.id, connection=r, serializer=job.serializer).latest_result().exc_string
    assert len(queues.queue(r, queues.upload_queue_name("testhost"))) == 0  # not retried forever
    assert spool_file.exists()  # good data never lost


def test_uploader_sends_a_batch_missing_from_the_plan_to_dead_letters(r, redis_server, tiny_model, tmp_path):
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="np", enqueue=False))
    queues.enqueue_upload(r, "testhost", "np", "b9999999", str(tmp_path / "spool" / "np" / "b9999999.safetensors"), 10,
                          "0" * 64, seq=1)
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    dead = ledger.dead_letters(r, "np")
    assert list(dead) == ["b9999999"] and "not in the plan" in dead["b9999999"]["last_error"]
    assert len(queues.queue(r, queues.upload_queue_name("testhost"))) == 0


def test_a_worker_job_for_a_batch_not_in_the_plan_fails_as_the_uploaders_does(r, redis_server, tiny_model, tmp_path):
    """One NotPlanned for both roles (hsx.errors), never a bare KeyError: its failure record names it."""
    from gpu_worker import runtime
    from gpu_worker.worker import run_worker
    from hsx.errors import NotPlanned
    from uploader import jobs

    assert runtime.NotPlanned is jobs.NotPlanned is NotPlanned
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="wnp", enqueue=False))
    queues.enqueue_extract(r, "wnp", "b9999999", seq=1)
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="wnp"))  # burst: returns once the queue is empty
    assert ledger.dead_letters(r, "wnp")["b9999999"]["last_error"] == "NotPlanned: batch b9999999 is not in the plan of run wnp"


def test_worker_process_stops_when_its_run_vanishes(r, redis_server, tiny_model, tmp_path):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="wv", enqueue=False))
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url}
    proc = subprocess.Popen([sys.executable, "-m", "hsx_cli.main", "worker", "--run", "wv", "--device", "cpu",
                             "--spool-dir", str(tmp_path / "spool"), "--host", "testhost", "--heartbeat-seconds", "0.5"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + scaled(120)
        while not r.zcard(RunKeys("wv").workers):
            assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
            time.sleep(0.2)
        r.flushall()
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=scaled(60))
        stopped_after = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "vanished from Redis" in out and "hsx produce" in out, out[-2000:]
    assert stopped_after < 30


def test_status_names_a_run_redis_does_not_have(r, redis_env):
    from tests.test_cli import hsx

    out = hsx("status", "--run", "ghost")
    # one rule for an unknown run in every command (issue 31 item 7): exit 2, one line naming it and what to run
    assert out.returncode == 2 and "not planned in this Redis" in out.stderr and "hsx produce" in out.stderr
