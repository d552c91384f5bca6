"""Start a run over: its Redis keys and queued jobs, and (when asked) its objects in the store.

`hsx produce` refuses a run whose manifest differs from the one recorded (DESIGN: a run
refuses to resume against a different manifest); a run planned with wrong settings is
reset here, then planned again. Nothing is deleted while a producer holds the run's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from hsx.errors import HsxError
from hsx.redisconn import text
from hsx.run import queues
from hsx.run.keys import RUNS, RunKeys
from hsx.store import layout


class ResetRefused(HsxError):
    """The run cannot be reset now; the message says why."""


@dataclass
class ResetPlan:
    """What a reset of ``run`` removes (counted first, shown, then removed)."""

    run: str
    redis_keys: list[str]
    jobs: dict[str, list[str]]                  # queue name -> job ids of this run
    store_url: str | None = None                # the store whose objects go too (None: kept)
    objects: list[str] = field(default_factory=list)

    def summary(self) -> str:
        jobs = sum(len(ids) for ids in self.jobs.values())
        line = f"run {self.run}: {len(self.redis_keys)} Redis keys, {jobs} queued jobs"
        if self.store_url is not None:
            return line + f", {len(self.objects)} objects under {self.store_url}/{self.run}/"
        return line


def plan_reset(r: redis.Redis, run: str, store=None) -> ResetPlan:
    layout.check_run_name(run)
    keys = RunKeys(run)
    if r.exists(keys.producer_lock):
        raise ResetRefused(f"run {run}: a producer is working on it (lock {keys.producer_lock}); stop it first")
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
    return ResetPlan(run, redis_keys, jobs, store.url() if store is not None else None, objects)


def apply_reset(r: redis.Redis, plan: ResetPlan, store=None) -> None:
    """Jobs first (no worker takes one of a run being reset), then the ledger, then the objects."""
    for name, ids in plan.jobs.items():
        q = queues.queue(r, name)
        for job_id in ids:
            q.remove(job_id)
            r.delete(f"rq:job:{job_id}")
    if plan.redis_keys:
        r.delete(*plan.redis_keys)
    r.srem(RUNS, plan.run)
    for key in plan.objects:
        store.delete(key)
    if store is not None:
        store.remove_empty_folders(f"{plan.run}/")  # a local store: no empty <run>/inputs/00000 left behind
