"""Fault injection with real processes and real signals.

One run of 480 samples through a private redis-server (AOF), 2 CPU workers and
2 uploaders (separate OS processes), moto's S3 server behind a proxy that can
go down or throttle. During the run every component is killed or stopped at
least once; afterwards `hsx verify` and a direct scan of the store must find
zero samples lost, zero duplicated, zero corrupt objects, an empty spool and
counters equal to the plan. The measured recovery times go to
test-artifacts/faults.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import boto3
import pytest
import torch

from hsx.batch import batchfile
from hsx.life import heartbeat, ledger, queues
from hsx.life.keys import RunKeys
from hsx.redisconn import LocalRedis, connect, int_hash, zset_members
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from tests.faultproxy import FaultProxy
from tests.pacedworker import PACED_HSX
from tests.waiting import scaled, wait_until

RUN, HOST = "faults", "h1"
SAMPLES = 480
LEASE, BEAT = 5, 1  # seconds: short so reclaim is quick in a test (defaults are 60 / 5)
PACED_BATCH_SECONDS = 0.8  # HSX_TEST_MIN_BATCH_SECONDS of the workers that meet the faults: "mid-batch" is hit


def _dataset(path, count=SAMPLES):
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines()]
    with open(path, "w") as fh:
        for i in range(count):
            row = dict(rows[i % len(rows)])
            row["id"] = f"s{i:04d}"
            fh.write(json.dumps(row) + "\n")
    return path


def _wait(what, predicate, timeout, step=0.2):
    """Poll for ``what``; ``timeout`` is a stall limit on a quiet machine, stretched on a loaded one."""
    return wait_until(what, predicate, timeout, interval=step)


class Roles:
    """Starts hsx roles as OS processes with one environment."""

    def __init__(self, env, spool, logs):
        self.env, self.spool, self.logs, self.procs = env, spool, logs, []

    def start(self, *args, name, env=None):
        log = open(self.logs / f"{name}-{len(self.procs)}.log", "w")
        proc = subprocess.Popen([*PACED_HSX, *args], env=env or self.env, stdout=log,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def worker(self, name, batch_seconds=PACED_BATCH_SECONDS):
        """``batch_seconds``: each batch stretched to at least this long (0: at the CPU's own pace)."""
        return self.start("worker", "--run", RUN, "--device", "cpu", "--spool-dir", str(self.spool), "--host", HOST,
                          "--heartbeat-seconds", str(BEAT), "--grace-seconds", "15",
                          "--spool-budget-gb", str(2.5e6 / 2**30), name=name,
                          env={**self.env, "HSX_TEST_MIN_BATCH_SECONDS": str(batch_seconds)})

    def uploader(self, name):
        return self.start("upload", "--spool-dir", str(self.spool), "--host", HOST,
                          "--heartbeat-seconds", str(BEAT), name=name)

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=scaled(30))
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.mark.slow
def test_nothing_lost_nothing_doubled(tmp_path, tiny_model, s3_server, s3_bucket, artifacts, request, monkeypatch,
                                      capsys):
    redis_dir = tmp_path / "redis"
    servers = [LocalRedis(redis_dir).start()]  # the first instance and the one restarted from its AOF
    request.addfinalizer(lambda: [s.stop() for s in servers])
    server = servers[0]
    proxy = FaultProxy(int(s3_server.rsplit(":", 1)[1]))
    proxy.set_mode("up")
    spool, logs = tmp_path / "spool", tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "HSX_REDIS_URL": server.url,
           "HSX_S3_ENDPOINT_URL": proxy.url, "HSX_S3_REGION": "us-east-1", "HSX_S3_ADDRESSING_STYLE": "path"}
    roles = Roles(env, spool, logs)
    r = connect(server.url)
    table = []
    try:
        for name in ("HSX_REDIS_URL", "HSX_S3_ENDPOINT_URL", "HSX_S3_REGION", "HSX_S3_ADDRESSING_STYLE"):
            monkeypatch.setenv(name, env[name])   # `hsx produce` in this process (the roles are processes)
        assert main(["produce", "--run", RUN, "--dataset", str(_dataset(tmp_path / "data.jsonl")),
                     "--model", str(tiny_model), "--layers", "dflash:3", "--store", f"s3://{s3_bucket}/runs",
                     "--token-budget", "512", "--dtype", "float32", "--max-length", "512", "--overlong", "truncate",
                     "--lease-seconds", str(LEASE)]) == 0, capsys.readouterr().err
        totals = ledger.run_totals(r, RUN)
        assert totals["samples"] == SAMPLES and totals["batches"] >= 100
        w1, w2 = roles.worker("w1"), roles.worker("w2")
        u1, u2 = roles.uploader("u1"), roles.uploader("u2")

        def done():
            return ledger.done_count(r, RUN)

        _wait("first batches done", lambda: done() >= 4, 90)

        # 1. A GPU worker killed with SIGKILL mid-batch: its batch is reclaimed after the lease.
        def w1_batch():
            for w in heartbeat.read_workers(r, RUN):
                bid = w.get("current_batch")
                if w.get("alive") and w.get("pid") == w1.pid and bid and r.zscore(RunKeys(RUN).extract_leases, bid):
                    return bid
        victim = _wait("w1 holding a leased batch", w1_batch, 30, step=0.05)
        w1.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()

        def reclaimed():
            rec = ledger.failures(r, RUN).get(victim)
            return rec and rec["last_error"].startswith("worker lost")
        _wait("batch reclaimed", reclaimed, 30, step=0.05)
        t_reclaim = time.monotonic() - t_kill
        assert t_reclaim <= LEASE + 2 * BEAT + 2
        _wait("victim batch done", lambda: ledger.is_done(r, RUN, victim), 60)
        table.append(("GPU worker SIGKILL mid-batch", f"kill -9 while it held {victim}", t_reclaim,
                      f"lease ({LEASE} s) expired, batch re-enqueued at the front, done by the other worker"))
        leftover_tmp = [p for p in spool.rglob("*.tmp-*")]
        w1 = roles.worker("w1-restarted")  # host restart: cleans temp files, re-enqueues complete spool files
        _wait("restarted worker cleans temp files", lambda: not any(p.exists() for p in leftover_tmp), 30)

        # 2. S3 endpoint down: spool fills to its budget, workers stop taking jobs, an uploader is killed
        #    mid-upload; when the endpoint returns everything drains.
        proxy.set_mode("down")
        t_down = time.monotonic()
        # The writer places a file only where it fits whole (hsx.runspec.spool.SpoolTiers.choose), so a full spool
        # sits just under its budget: wait until it holds over half of it and the spooled count stops moving.
        seen = {"n": -1, "since": time.monotonic()}

        def spool_full():
            n = int(r.zcard(RunKeys(RUN).spooled_log))
            if n != seen["n"]:
                seen.update(n=n, since=time.monotonic())
            held = heartbeat.read_hosts(r, RUN).get(HOST, {}).get("spool_bytes", 0)
            return held >= 1.25e6 and time.monotonic() - seen["since"] >= 2 * BEAT + 1

        _wait("spool at budget", spool_full, 60)
        spooled_at_budget = int(r.zcard(RunKeys(RUN).spooled_log))
        time.sleep(3)
        spooled_later = int(r.zcard(RunKeys(RUN).spooled_log))
        assert spooled_later - spooled_at_budget <= 2, "workers kept taking jobs with a full spool"
        _wait("an upload in flight", lambda: r.zcard(RunKeys(RUN).upload_leases) > 0, 30)
        stuck_uploads = zset_members(r, RunKeys(RUN).upload_leases)
        u1.send_signal(signal.SIGKILL)
        done_during = done()
        time.sleep(max(0.0, 10 - (time.monotonic() - t_down)))
        assert done() == done_during, "a batch was recorded done while the store was down"
        proxy.set_mode("up")
        t_up = time.monotonic()
        _wait("uploads resume", lambda: done() > done_during, 90)
        t_resume = time.monotonic() - t_up
        _wait("stuck uploads done", lambda: all(ledger.is_done(r, RUN, b) for b in stuck_uploads), 90)
        t_stuck = time.monotonic() - t_up
        table.append(("S3 endpoint down 10 s + spool full", "proxy closed; spool budget 2.5 MB", t_resume,
                      f"GPU workers paused at {spooled_at_budget} spooled batches; first upload {t_resume:.1f} s after return"))
        table.append(("Uploader SIGKILL mid-upload", "kill -9 while retrying an upload in the outage", t_stuck,
                      f"spool files kept; uploads of {sorted(stuck_uploads)} done after the store returned"))
        u1 = roles.uploader("u1-restarted")

        # 3. Throttling: every request answered 503 SlowDown for 5 s.
        proxy.set_mode("slowdown")
        time.sleep(5)
        before = done()
        proxy.set_mode("up")
        t_up = time.monotonic()
        _wait("uploads after throttling", lambda: done() > before, 90)
        table.append(("S3 503 SlowDown 5 s", "proxy answers 503 SlowDown", time.monotonic() - t_up,
                      "retried with backoff + jitter"))

        # 4. Redis killed with SIGKILL and restarted from its AOF.
        done_before_kill = ledger.done_ids(r, RUN)
        time.sleep(1.2)  # let appendfsync everysec flush what was acknowledged
        server.stop(kill=True)
        t_kill = time.monotonic()
        time.sleep(3)
        servers.append(LocalRedis(redis_dir, port=server.port).start())
        r = connect(server.url)
        assert done_before_kill <= ledger.done_ids(r, RUN), "the ledger lost entries across the Redis restart"
        before = done()
        _wait("progress after Redis restart", lambda: done() > before, 90)
        table.append(("Redis SIGKILL + restart (AOF)", "kill -9 redis-server, restart after 3 s",
                      time.monotonic() - t_kill, "clients reconnected with backoff; ledger intact"))

        # 5. Duplicate delivery: a queued batch enqueued twice more (two workers take it), a done batch again.
        queued = [queues.batch_of_job(j)[1] for j in queues.queue(r, queues.extract_queue_name(RUN)).get_job_ids()]
        dup_target = queued[-1] if queued else None
        if dup_target:
            queues.enqueue_extract(r, RUN, dup_target, seq=990)
            queues.enqueue_extract(r, RUN, dup_target, seq=991)
        queues.enqueue_extract(r, RUN, sorted(ledger.done_ids(r, RUN))[0], seq=992)
        table.append(("Duplicate delivery", f"extra jobs for queued {dup_target} and a done batch", 0.0,
                      "one object, one ledger entry"))

        # 5b. The extract queue emptied at /rq (rq's Queue.empty: jobs and list deleted): the reconciler in the
        #     workers' and uploaders' heartbeats puts every planned batch back, within 2 x lease.
        extract_q = queues.queue(r, queues.extract_queue_name(RUN))
        emptied = {queues.batch_of_job(j)[1] for j in extract_q.get_job_ids()} - ledger.done_ids(r, RUN)
        extract_q.empty()
        t_empty = time.monotonic()

        def back():
            pending = queues.pending_extract(r, RUN) | queues.pending_upload(r, HOST, RUN) | ledger.done_ids(r, RUN)
            return emptied <= pending
        _wait("emptied batches back in the queue", back, 4 * LEASE, step=0.1)
        t_back = time.monotonic() - t_empty
        assert not emptied or t_back <= 2 * LEASE + BEAT
        table.append(("Extract queue emptied at /rq", f"rq Queue.empty() with {len(emptied)} batches queued", t_back,
                      f"reconciler re-enqueued them (interval and grace {LEASE / 2:.1f} s = lease / 2)"))

        # 6. SIGTERM (docker compose stop): the worker finishes its batch and exits 0 within the grace period.
        w2.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        assert w2.wait(timeout=scaled(30)) == 0
        table.append(("GPU worker SIGTERM", "docker compose stop", time.monotonic() - t_term,
                      "finished its batch, wrote it, exited 0"))
        u2.send_signal(signal.SIGTERM)
        assert u2.wait(timeout=scaled(60)) == 0
        # Every fault is in: the worker that finishes the run (over half its batches) goes at the CPU's pace.
        w2, u2 = roles.worker("w2-restarted", batch_seconds=0), roles.uploader("u2-restarted")

        _wait("run complete", lambda: ledger.run_totals(r, RUN)["batches"] == done()
              and r.get(RunKeys(RUN).index_written), 150)
        # Let the duplicate jobs finish too: they must leave nothing behind.
        _wait("queues drained", lambda: not queues.pending_extract(r, RUN) and not queues.pending_upload(r, HOST, RUN), 60)
    finally:
        roles.stop_all()
        proxy.set_mode("up")

    verify = subprocess.run([sys.executable, "-m", "hsx_cli.main", "verify", "--run", RUN], env=env,
                            capture_output=True, text=True, timeout=scaled(120))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # Direct scan of the store: every sample exactly once, nothing corrupt.
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix=f"runs/{RUN}/batches/")
            for o in page.get("Contents", [])]
    seen = Counter()
    for key in keys:
        contents = batchfile.read_batch_bytes(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read(), where=key)
        assert bool(torch.isfinite(contents.hidden_states).all())
        seen.update(contents.sample_ids)
    lost = SAMPLES - len(seen)
    duplicated = sum(c - 1 for c in seen.values())
    assert len(keys) == totals["batches"] and lost == 0 and duplicated == 0
    assert [p for p in spool.rglob("*") if p.is_file()] == []
    counters = int_hash(r, RunKeys(RUN).counters)
    assert counters["batches"] == totals["batches"] and counters["samples"] == SAMPLES and counters["tokens"] == totals["tokens"]
    assert not ledger.dead_letters(r, RUN)
    lines = ["| fault | how injected | recovery (s) | what happened | samples lost | duplicates |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {f} | {how} | {t:.1f} | {what} | {lost} | {duplicated} |" for f, how, t, what in table]
    (artifacts / "faults.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
