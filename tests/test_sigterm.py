"""Every role exits within a stated bound after SIGTERM, in every state (issue 37 item 9).

The bound (docs/deploy.md, "Stopping"): STOP_BOUND_SECONDS, plus for a worker the batch in hand (its forward,
then its write within --grace-seconds; past that it is handed back). Real processes, a real SIGTERM, the bound
stretched by tests/waiting.py as every wait is. Before: a `--burst` worker whose spool folder was removed had not
exited 2 minutes after SIGTERM, and the SLURM recipe sent a second SIGTERM as a backstop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsx.life import heartbeat, ledger, queues
from hsx.life.keys import RunKeys
from hsx.redisconn import LocalRedis, connect, free_port
from hsx.store import StoreSettings
from hsx_tools.demo import sample_dataset
from tests.faultproxy import FaultProxy
from tests.pacedworker import PACED_HSX
from tests.pipeline import produce_config
from tests.waiting import scaled, wait_until

STOP_BOUND_SECONDS = 10   # docs/deploy.md: every role, every state, after SIGTERM (plus a worker's batch in hand)
BATCH_SECONDS = 2.0       # HSX_TEST_MIN_BATCH_SECONDS: a batch in hand lasts this long
GRACE_SECONDS = 5         # --grace-seconds of these workers


class Roles:
    """hsx processes of one test, each with its log; all killed at the end, whatever happened."""

    def __init__(self, tmp: Path, env: dict):
        self.tmp, self.env, self.procs, self.stopped = tmp, env, {}, set()

    def start(self, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([*PACED_HSX, *argv], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def alive(self, *names: str) -> None:
        for name in names or set(self.procs) - self.stopped:
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{self.log(name)[-3000:]}"

    def said(self, name: str, text: str, stall: float = 60) -> None:
        wait_until(f"{name} says {text!r}", lambda: text in self.log(name), stall, check=lambda: self.alive(name))

    def stop(self, name: str, extra: float = 0.0) -> float:
        """SIGTERM, then the seconds until it exited; fails past the bound (+ ``extra``), stretched by load."""
        proc, bound = self.procs[name], scaled(STOP_BOUND_SECONDS + extra)
        t0 = time.monotonic()
        self.stopped.add(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running {bound:.0f} s after SIGTERM:\n{self.log(name)[-3000:]}")
        seconds = time.monotonic() - t0
        assert "unexpected error" not in self.log(name), self.log(name)[-3000:]
        print(f"{name}: exited {seconds:.1f} s after SIGTERM (rc {proc.returncode})")
        return seconds

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _dataset(path: Path, count: int) -> Path:
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines()]
    path.write_text("".join(json.dumps({**rows[i % len(rows)], "id": f"s{i:04d}"}) + "\n" for i in range(count)))
    return path


def _env(redis_url: str, **extra) -> dict:
    return {**os.environ, "HSX_REDIS_URL": redis_url, "HSX_HEARTBEAT_SECONDS": "1", "HSX_GRACE_SECONDS":
            str(GRACE_SECONDS), "HSX_TEST_MIN_BATCH_SECONDS": str(BATCH_SECONDS), "HSX_MEMORY_SPOOL_BUDGET_GB": "0",
            "HSX_LOG_EVERY_SECONDS": "1", **extra}


def _plan(redis_url: str, tmp: Path, model: Path, run: str, store=None, samples: int = 40) -> None:
    from producer.produce import produce

    produce(produce_config(redis_url, model, store or str(tmp / "store"), run=run, dataset=_dataset(tmp / f"{run}.jsonl", samples),
                           token_budget=256, max_length=256, overlong="truncate", lease_seconds=8))


def _worker(roles: Roles, name: str, run: str, spool: Path, *flags: str) -> subprocess.Popen:
    return roles.start(name, "worker", "--run", run, "--device", "cpu", "--spool-dir", str(spool), "--host", "sig",
                       "--name", f"gpu-{name}", *flags)


def _holding(r, run: str, name: str):
    for w in heartbeat.read_workers(r, run):
        if w["worker"] == f"gpu-{name}" and w.get("alive") and w.get("current_batch"):
            return w["current_batch"]
    return None


def test_a_worker_stops_in_bound_idle_mid_batch_in_burst_with_its_folders_removed_and_waiting_for_a_plan(
        tmp_path, tiny_model, r, redis_server):
    url = redis_server.url
    roles = Roles(tmp_path, _env(url))
    try:
        # the four workers start together (each is stopped in its own state below, one at a time)
        _plan(url, tmp_path, tiny_model, "sig-idle", samples=8)
        keys = RunKeys("sig-idle")
        r.delete(queues.queue(r, queues.extract_queue_name("sig-idle")).key)
        r.hset(keys.counters, "batches", ledger.run_totals(r, "sig-idle")["batches"])
        _plan(url, tmp_path, tiny_model, "sig-busy")
        _worker(roles, "idle", "sig-idle", tmp_path / "spool-idle")
        _worker(roles, "busy", "sig-busy", tmp_path / "spool-busy")
        _worker(roles, "burst", "sig-busy", tmp_path / "spool-burst", "--burst")
        _worker(roles, "plan", "sig-never", tmp_path / "spool-plan", "--wait-for-plan")
        # idle: the run complete, its queue empty
        roles.said("idle", "complete, idle")
        roles.stop("idle")
        # mid-batch, and a --burst worker whose spool folder was removed under it (issue 37 item 9), side by side
        wait_until("both holding a batch", lambda: _holding(r, "sig-busy", "busy") and _holding(r, "sig-busy", "burst"),
                   60, check=roles.alive)
        held = _holding(r, "sig-busy", "burst")
        shutil.rmtree(tmp_path / "spool-burst")
        wait_until("burst past the batch it held", lambda: _holding(r, "sig-busy", "burst") != held, 30,
                   check=roles.alive, interval=0.05)  # its write met the folder gone
        roles.stop("burst", extra=BATCH_SECONDS)
        wait_until("busy holding a batch", lambda: _holding(r, "sig-busy", "busy"), 30, check=roles.alive, interval=0.05)
        roles.stop("busy", extra=BATCH_SECONDS)
        # waiting for a plan that never comes
        roles.said("plan", "not planned yet")
        roles.stop("plan")
    finally:
        roles.kill_all()
    assert roles.procs["busy"].returncode == 0 and roles.procs["idle"].returncode == 0


def test_a_worker_and_an_uploader_stop_in_bound_while_redis_is_away(tmp_path, tiny_model):
    server = LocalRedis(tmp_path / "redis").start()
    roles = Roles(tmp_path, _env(server.url))
    try:
        _plan(server.url, tmp_path, tiny_model, "sig-redis")
        _worker(roles, "worker", "sig-redis", tmp_path / "spool")
        roles.start("uploader", "upload", "--spool-dir", str(tmp_path / "spool"), "--host", "sig", "--name", "up-redis")
        r = connect(server.url)
        wait_until("a batch done", lambda: ledger.done_count(r, "sig-redis") >= 1, 60, check=roles.alive)
        server.stop()
        roles.said("worker", "lost (")
        roles.said("uploader", "lost (")
        roles.stop("worker")
        roles.stop("uploader")
    finally:
        roles.kill_all()
        server.stop()
    for name in ("worker", "uploader"):  # one line each way, no traceback, no flood
        said = [line for line in roles.log(name).splitlines() if " WARNING " in line or " ERROR " in line]
        assert [line.split(": ", 1)[1].split(" (")[0] for line in said] == [
            f"Redis at {server.url} lost", f"{'worker gpu-worker' if name == 'worker' else 'uploader up-redis'} stops without Redis"], said
        assert "Traceback" not in roles.log(name)
    # a CPU worker runs tree batches group by group, choosing at hsx worker's default price (said at info)
    assert "it runs a batch's samples alone where its trees cost more at 2560 tokens a forward" in roles.log("worker")


def test_a_worker_and_an_uploader_stop_in_bound_while_the_store_is_away(tmp_path, tiny_model, s3_server, s3_bucket,
                                                                       r, redis_server):
    proxy = FaultProxy(int(s3_server.rsplit(":", 1)[1]))
    proxy.set_mode("up")
    s3 = {"HSX_S3_ENDPOINT_URL": proxy.url, "HSX_S3_REGION": "us-east-1", "HSX_S3_ADDRESSING_STYLE": "path"}
    roles = Roles(tmp_path, _env(redis_server.url, **s3))
    try:
        _plan(redis_server.url, tmp_path, tiny_model, "sig-store", samples=80,
              store=StoreSettings(url=f"s3://{s3_bucket}/runs", endpoint_url=proxy.url, region="us-east-1",
                                  addressing_style="path"))
        _worker(roles, "worker", "sig-store", tmp_path / "spool")
        roles.start("uploader", "upload", "--spool-dir", str(tmp_path / "spool"), "--host", "sig", "--name", "up-store")
        wait_until("a batch done", lambda: ledger.done_count(r, "sig-store") >= 1, 60, check=roles.alive)
        proxy.set_mode("down")
        roles.said("uploader", "retrying")
        roles.stop("uploader")
        roles.said("worker", "retrying", stall=120)  # its prefetch of the next inputs
        roles.stop("worker", extra=BATCH_SECONDS)
    finally:
        roles.kill_all()
        proxy.set_mode("down")


def test_the_producer_and_the_dashboard_stop_in_bound(tmp_path, tiny_model, r, redis_server):
    roles = Roles(tmp_path, _env(redis_server.url, HSX_DASHBOARD_TOKEN="t" * 32))
    try:
        roles.start("produce", "produce", "--run", "sig-produce", "--dataset", str(_dataset(tmp_path / "big.jsonl", 4000)),
                    "--model", str(tiny_model), "--store", str(tmp_path / "store"), "--layers", "dflash:3",
                    "--token-budget", "256", "--max-length", "256", "--overlong", "truncate", "--window-rows", "500",
                    "--tokenise-workers", "1")
        wait_until("planning", lambda: ledger.run_totals(r, "sig-produce").get("planning"), 60,
                   check=lambda: roles.alive("produce"))
        roles.stop("produce")
        # It unwinds: the run's lock released (the same command again is not refused for 30 s) and no temp file of
        # a plan window left in the store (a complete run verified "GAPS FOUND" over one). It died by the
        # signal's default action before (rc -15).
        assert roles.procs["produce"].returncode == 128 + signal.SIGTERM
        assert "hsx produce: stopped by SIGTERM" in roles.log("produce")
        assert not r.exists(RunKeys("sig-produce").producer_lock)
        assert not list((tmp_path / "store").rglob(".*.tmp-*"))
        port = free_port()
        roles.start("dashboard", "dashboard", "--port", str(port))
        wait_until("the dashboard listens", lambda: socket.create_connection(("127.0.0.1", port), timeout=scaled(2)).close() or True,
                   60, retry_on=(OSError,), check=lambda: roles.alive("dashboard"))
        roles.stop("dashboard")
    finally:
        roles.kill_all()


def test_a_role_that_hangs_after_its_stop_request_exits_at_its_deadline_and_says_where_it_was():
    """The role's own bound (hsx/fleet/stopping.py), here with a main thread that never returns."""
    code = ("import logging, time\n"
            "logging.basicConfig()\n"
            "from hsx import retry\n"
            "from hsx.fleet.stopping import StopDeadline\n"
            "StopDeadline('worker w', 1.0).arm()\n"
            "retry.STOP.set()\n"
            "def stuck_here():\n"
            "    while True:\n"
            "        time.sleep(0.2)\n"
            "stuck_here()\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(30))
    assert out.returncode == 1 and time.monotonic() - t0 < scaled(10), out
    assert "worker w still running 1 s after its stop request: exiting now" in out.stderr
    assert "stuck_here" in out.stderr  # the stack of the thread that hung
