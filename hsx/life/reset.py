"""Start a run over: its Redis keys and queued jobs, and (when asked) its objects in the store.

`hsx produce` refuses a run whose manifest differs from the one recorded (a run
refuses to resume against a different manifest); a run planned with wrong settings is
reset here, then planned again. Nothing is deleted while a producer holds the run's lock, nor (unless
the user overrides it, knowing what it risks) while the run's workers beat or batches are leased: a live
worker or uploader would write its keys back into the run planned next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from hsx.errors import HsxError
from hsx.life import heartbeat, leases, queues
from hsx.life.keys import RUNS, RunKeys
from hsx.redisconn import text
from hsx.store import layout


class ResetRefused(HsxError):
    """The run cannot be reset now; the message says why."""


@dataclass
class ResetPlan:
    """What a reset of ``run`` removes (counted first, shown, then removed)."""

    run: str
    redis_keys: list[str]
    jobs: dict[str, list[str]]                  # queue name -> job ids of this run
    objects_under: str | None = None            # the run's folder in the store, whose objects go too (None: kept)
    objects: list[str] = field(default_factory=list)

    def summary(self) -> str:
        jobs = sum(len(ids) for ids in self.jobs.values())
        line = f"run {self.run}: {len(self.redis_keys)} Redis keys, {jobs} queued jobs"
        if self.objects_under is not None:
            return line + f", {len(self.objects)} objects under {self.objects_under}"
        return line


LIVE_RISK = ("they may write keys back into the run planned next (a heartbeat, a lease, a batch marked done) "
             "and upload the old plan's spool files")


def live_roles(r: redis.Redis, run: str) -> list[str]:
    """What of the run still lives: workers whose heartbeat has not expired, batches an extractor or an
    uploader holds a lease on (lease expiry against Redis' clock)."""
    keys = RunKeys(run)
    out = [f"worker {w['worker']}" for w in heartbeat.read_workers(r, run) if w["alive"]]
    now = leases.redis_now(r)
    for what, key in (("extracting", keys.extract_leases), ("uploading", keys.upload_leases)):
        held = [text(b) for b in r.zrangebyscore(key, now, "+inf")]
        if held:
            out.append(f"{len(held)} batches {what} ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})")
    return out


def plan_reset(r: redis.Redis, run: str, store=None, allow_live: bool = False) -> ResetPlan:
    """``allow_live``: reset even while the run's roles live (LIVE_RISK); else refused naming them."""
    layout.check_run_name(run)
    keys = RunKeys(run)
    if r.exists(keys.producer_lock):
        raise ResetRefused(f"run {run}: a producer is working on it (lock {keys.producer_lock}); stop it first")
    live = [] if allow_live else live_roles(r, run)
    if live:
        raise ResetRefused(f"run {run} is live: {'; '.join(live)}; stop its workers and uploaders first "
                           f"(or --even-if-live: {LIVE_RISK}); nothing was changed")
    redis_keys = sorted(text(k) for k in r.scan_iter(match=f"hsx:{run}:*", count=1000))
    jobs: dict[str, list[str]] = {}
    names = [text(n).removeprefix("rq:queue:") for n in r.smembers("rq:queues")]
    for name in sorted(set(names) | {queues.extract_queue_name(run)}):
        if name != queues.extract_queue_name(run) and not name.startswith("upload@"):
            continue
        ids = [j for j in queues.queue(r, name).get_job_ids() if (queues.batch_of_job(j) or ("",))[0] == run]
        if ids:
            jobs[name] = ids
    objects = store.list_keys(f"{run}/") if store is not None else []
    under = f"{store.url(run).rstrip('/')}/" if store is not None else None   # store.url() may end in its own "/"
    return ResetPlan(run, redis_keys, jobs, under, objects)


def apply_reset(r: redis.Redis, plan: ResetPlan, store=None) -> None:
    """Jobs first (no worker takes one of a run being reset), then the ledger, then the objects. The run is
    marked being reset first: no reconciler enqueues it again while its jobs are gone and its plan is not."""
    r.set(RunKeys(plan.run).resetting, "1")
    for name, ids in plan.jobs.items():
        q = queues.queue(r, name)
        for job_id in ids:
            q.remove(job_id)
            r.delete(f"rq:job:{job_id}")
    r.delete(*plan.redis_keys, RunKeys(plan.run).resetting)
    r.srem(RUNS, plan.run)
    for key in plan.objects:
        store.delete(key)
    if store is not None:
        store.remove_empty_folders(f"{plan.run}/")  # a local store: no empty <run>/inputs/00000 left behind
