"""A role stopped before it takes its first job (loading the model, waiting for a plan) exits 0 and says so.

A pod evicted while it starts (KEDA scaling down a worker it scaled up a second before) met the default action of
SIGTERM: exit -15, no line; tests/test_k8s.py's scaling test saw it at load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.waiting import scaled, wait_until


def test_a_worker_stopped_while_waiting_for_a_plan_exits_0_and_says_so(redis_server, tmp_path):
    log = tmp_path / "worker.log"
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url, "HSX_SPOOL_DIR": str(tmp_path / "spool")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hsx_cli.main", "worker", "--run", "never", "--device", "cpu",
                                 "--wait-for-plan"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until("the worker waits for a plan", lambda: "not planned yet" in log.read_text(), 60,
                   check=lambda: proc.poll() is None)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(30)) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "hsx worker: stopped while starting (SIGTERM): no job was taken" in text, text
    assert "Traceback" not in text and "unexpected error" not in text, text
