"""A worker with a fixed --name, SIGKILLed mid-batch, restarts at once under the same name (issue 23 item 5)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from hsx.life import heartbeat, ledger
from hsx.monitor.progress import run_progress
from producer.produce import produce
from tests.pacedworker import PACED_HSX
from tests.pipeline import produce_config
from tests.waiting import scaled

NAME = "gpu-fixed-0"


def _worker(env, spool, burst=False):
    args = [*PACED_HSX, "worker", "--run", "t1", "--device", "cpu", "--spool-dir", str(spool),
            "--host", "testhost", "--name", NAME, "--heartbeat-seconds", "1"] + (["--burst"] if burst else [])
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_named_worker_restarts_at_once_and_sweeps_its_temp_file(r, redis_server, tiny_model, tmp_path):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), lease_seconds=10))
    spool = tmp_path / "spool"
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url, "HSX_TEST_MIN_BATCH_SECONDS": "3"}
    first = _worker(env, spool)
    try:
        deadline = time.monotonic() + scaled(90)
        while not any(w.get("current_batch") for w in heartbeat.read_workers(r, "t1") if w.get("worker") == NAME):
            assert time.monotonic() < deadline and first.poll() is None, "the worker never took a batch"
            time.sleep(0.1)
        # what a writer killed mid-write leaves: a temp file under the worker's own name
        leftover = spool / "t1" / f"b0000000.safetensors.tmp-{NAME}"
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_bytes(b"partial")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=scaled(10))
    finally:
        if first.poll() is None:
            first.kill()
    started = time.monotonic()
    again = _worker({**env, "HSX_TEST_MIN_BATCH_SECONDS": "0"}, spool, burst=True)
    out, _ = again.communicate(timeout=scaled(300))
    assert again.returncode == 0, out[-3000:]
    assert "active worker named" not in out
    assert not leftover.exists()
    assert time.monotonic() - started < 120
    # it worked: every batch but the killed one spooled by the restarted worker (that one comes back after its lease)
    spooled = r.zcard("hsx:t1:spooled_log")
    assert spooled >= ledger.run_totals(r, "t1")["batches"] - 1
    assert not run_progress(r, "t1")["dead_letters"]
