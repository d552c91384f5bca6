"""Issue 29 item 5: a run no one may enqueue stays off the queue, whoever reconciles.

Before: `hsx produce --no-enqueue` planned 265 batches, and 33 s later the reconciler inside uploaders serving
another run re-enqueued all of them; status then said "265 queued ... STALLED no live worker". The same gap let a
reconcile pass re-enqueue a run while `hsx reset` removed it (jobs gone, plan not yet), leaving jobs of a run
that no longer exists; and a plan-only producer that died mid-plan left a plan the next pass enqueued.
"""

from __future__ import annotations

import time

import pytest

from hsx.life import ledger, queues, reconcile, reset
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress, summary_lines
from producer.produce import produce
from tests.pipeline import produce_config, upload_config
from uploader.runtime import UploaderRuntime

LEASE = 2  # s: the reconciler's interval and grace are half of it


def beat_for(rt, seconds: float) -> None:
    """The uploader's heartbeat, as its thread runs it (reap + reconcile every run it sees)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rt.beat()
        time.sleep(0.3)


def extract_jobs(r, run: str) -> int:
    return len(queues.queue(r, queues.extract_queue_name(run)))


def test_a_plan_only_run_stays_off_the_queue_until_started(r, redis_server, tiny_model, tmp_path):
    store = str(tmp_path / "store")
    report = produce(produce_config(redis_server.url, tiny_model, store, run="po", enqueue=False, lease_seconds=LEASE))
    assert report.enqueued == 0 and report.planned_only and any("planned only" in line for line in report.lines())
    produce(produce_config(redis_server.url, tiny_model, store, run="busy", lease_seconds=LEASE))  # another run
    rt = UploaderRuntime(upload_config(redis_server.url, tmp_path / "spool"), r)
    beat_for(rt, 4 * LEASE)  # several reconcile intervals and graces
    assert extract_jobs(r, "po") == 0
    assert not r.exists(RunKeys("po").orphans)
    p = run_progress(r, "po")
    assert p["planned_only"] and p["stalled"] is None
    lines = "\n".join(summary_lines(p))
    assert "PLANNED ONLY" in lines and "without --no-enqueue" in lines and "STALLED" not in lines
    # Planned only again (a second --no-enqueue call) is still planned only; the call without it starts the run.
    assert produce(produce_config(redis_server.url, tiny_model, store, run="po", enqueue=False,
                                  lease_seconds=LEASE)).planned_only
    started = produce(produce_config(redis_server.url, tiny_model, store, run="po", lease_seconds=LEASE))
    total = ledger.run_totals(r, "po")["batches"]
    assert not started.planned_only and started.enqueued == total == extract_jobs(r, "po")
    assert not run_progress(r, "po")["planned_only"]
    # A started run is reconciled again: a lost job comes back.
    q = queues.queue(r, queues.extract_queue_name("po"))
    r.lrem(q.key, 1, q.get_job_ids()[0])
    beat_for(rt, 4 * LEASE)
    assert extract_jobs(r, "po") == total


def test_a_started_run_stays_started_under_a_plan_only_call(r, redis_server, tiny_model, tmp_path):
    store = str(tmp_path / "store")
    produce(produce_config(redis_server.url, tiny_model, store, run="st", lease_seconds=LEASE))
    assert not produce(produce_config(redis_server.url, tiny_model, store, run="st", enqueue=False,
                                      lease_seconds=LEASE)).planned_only
    assert not r.exists(RunKeys("st").planned_only)


def test_a_plan_only_producer_that_died_mid_plan_is_not_enqueued(r, redis_server, tiny_model, tmp_path):
    def die(name, window):
        if name == "recorded" and window == 0:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="pd", enqueue=False,
                               window_rows=40, lease_seconds=LEASE), on_event=die)
    assert ledger.all_specs(r, "pd") and not r.exists(RunKeys("pd").producer_lock)
    for _ in range(3):
        assert reconcile.reconcile(r, "pd", grace=0) == []
    assert extract_jobs(r, "pd") == 0


def test_a_run_being_reset_is_not_enqueued_again(r, redis_server, tiny_model, tmp_path):
    """A reconcile pass made after `hsx reset` removed the run's jobs and before it removed the plan."""
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rr", lease_seconds=LEASE))
    plan = reset.plan_reset(r, "rr")
    assert plan.jobs

    class Between:
        """The Redis client reset uses, with reconcile passes of another process run before the run's keys go."""

        def __init__(self, client):
            self._client = client
            self.passes: list[list[str]] = []

        def __getattr__(self, name):
            return getattr(self._client, name)

        def delete(self, *names):
            if RunKeys("rr").plan in names:
                self.passes = [reconcile.reconcile(r, "rr", grace=0) for _ in range(2)]
            return self._client.delete(*names)

    between = Between(r)
    reset.apply_reset(between, plan)
    assert between.passes == [[], []]
    assert extract_jobs(r, "rr") == 0 and not list(r.scan_iter(match="hsx:rr:*"))
    assert not any(":rr:" in job_id for job_id in map(str, r.keys("rq:job:*")))


def test_a_reconcile_pass_aborts_when_the_run_is_marked_during_it(r, redis_server, tiny_model, tmp_path, monkeypatch):
    """The pass reads, then writes in one transaction WATCHing the marks: a reset that starts in between wins."""
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="race", enqueue=False,
                           lease_seconds=LEASE))
    r.delete(RunKeys("race").planned_only)        # orphans, as a producer killed before enqueueing leaves them
    r.set(RunKeys("race").fed, r.hget(RunKeys("race").totals, "batches"))   # ... once fed (else a pass feeds them)
    assert reconcile.reconcile(r, "race", grace=0) == []   # first sighting
    real_orphans = reconcile.orphans

    def orphans_then_reset_starts(client, run, **how):
        found = real_orphans(client, run, **how)
        r.set(RunKeys(run).resetting, "1")
        return found

    monkeypatch.setattr(reconcile, "orphans", orphans_then_reset_starts)
    assert reconcile.reconcile(r, "race", grace=0) == []
    assert extract_jobs(r, "race") == 0
