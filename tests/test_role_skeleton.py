"""A new role is one folder plus one entry in hsx_cli's COMMANDS: tests/toyrole (`hsx tally`) is such a role,
built on hsx/fleet/role.py only. Run as a real `hsx` process against the private redis-server, it heartbeats (and
shows in the run's worker list, as `hsx status` reads it), logs progress, runs its own jobs and no other
role's, and stops cleanly on SIGTERM: exit 0, summary logged, heartbeat and rq registration gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from hsx.life import heartbeat, queues
from hsx.life.keys import RunKeys
from tests.toyrole.runtime import ADD_FUNC, TallyRuntime
from tests.waiting import scaled, wait_until

ROOT = Path(__file__).resolve().parents[1]
IDLE = "INFO hsx.fleet.role: idle: tally tally-1 waits for jobs on tally:toy"
# `hsx` with the one line a new role adds to hsx_cli/main.py: its command in COMMANDS.
HSX_WITH_TALLY = ("import sys; from hsx_cli import main; from tests.toyrole.command import COMMAND; "
                  "main.COMMANDS += (COMMAND,); sys.exit(main.main())")


def test_a_job_outside_its_role_process_is_refused():
    with pytest.raises(RuntimeError, match=r"tally jobs run only inside `hsx tally`"):
        TallyRuntime.current()


def test_a_toy_role_heartbeats_logs_and_stops_on_sigterm(r, redis_server, tmp_path):
    log_path = tmp_path / "tally.log"
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", HSX_WITH_TALLY, "tally", "--run", "toy", "--host", "h1",
                                 "--name", "tally-1", "--heartbeat-seconds", "0.3", "--log-every-seconds", "0.5"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True)
    try:
        def alive() -> None:
            assert proc.poll() is None, log_path.read_text()

        def me() -> dict | None:
            return next((w for w in heartbeat.read_workers(r, "toy") if w["worker"] == "tally-1" and w["alive"]), None)

        first = wait_until("the tally's heartbeat", me, 60, check=alive, describe=log_path.read_text)
        assert first["host"] == "h1" and first["pid"] == proc.pid and first["batches"] == 0

        q = queues.queue(r, "tally:toy")
        for n in (5, 7, 30):
            q.enqueue_call(ADD_FUNC, kwargs={"run": "toy", "n": n}, job_id=f"add-{n}")
        q.enqueue_call(queues.EXTRACT_FUNC, kwargs={"run": "toy", "batch_id": "b0", "attempt": 1}, job_id="forged")
        # The heartbeat carries the role's totals; the progress line its rate and queue.
        wait_until("three numbers added", lambda: (me() or {}).get("batches") == 3, 60, check=alive,
                   describe=log_path.read_text)
        wait_until("a progress line after the jobs", lambda: "tally tally-1: 3 batches; last " in log_path.read_text(), 60,
                   check=alive)
        wait_until("the idle line", lambda: log_path.read_text().endswith(IDLE + "\n"), 60, check=alive)
        failed = FailedJobRegistry("tally:toy", connection=r, serializer=JSONSerializer)
        wait_until("the forged job refused", lambda: "forged" in failed.get_job_ids(), 60, check=alive)
        assert r.exists(RunKeys("toy").heartbeat("tally-1"))
        assert "tally-1" in {w.name for w in Worker.all(connection=r)}

        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert proc.returncode == 0, text
    assert out.strip() == "tally tally-1: 3 numbers, sum 42"
    assert "ready: tally tally-1 taking jobs from tally:toy" in text
    assert "ForbiddenJob" in text and "this worker only runs ['tests.toyrole.jobs.add']" in text
    lines = text.rstrip().splitlines()
    assert sum(line.endswith(IDLE) for line in lines) == 1, text                # said once, then silence
    assert lines[-2].endswith(IDLE) and re.search(r"INFO hsx.fleet.role: tally tally-1: 3 batches; last \d+s: 0.0 batches/min; "
                                                  r"tally:toy queue 0$", lines[-1]), text  # the summary on exit
    assert not r.exists(RunKeys("toy").heartbeat("tally-1"))          # gone, not dead: no 6-beat wait
    assert "tally-1" not in {w.name for w in Worker.all(connection=r)}  # rq's registration too
