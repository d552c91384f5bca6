"""The reconciler: the queue is a cache of the ledger, rebuilt from the plan whatever emptied it.

A planned batch is *accounted for* when it is done, queued (extract queue or
any host's upload queue), leased (extract or upload lease) or dead. Anything
else is an orphan: a worker died between rq's dequeue and taking the lease,
someone emptied or deleted jobs at /rq, a producer died between saving the
plan and enqueueing. A pass re-enqueues (at the front) every batch that was
an orphan in the previous pass too and has been one for at least ``grace``
seconds (so the ms-wide gaps of normal hand-overs, e.g. dequeue -> lease, are
never mistaken for loss). A batch whose job rq has handed out (in a queue's
intermediate list or started registry) but that holds no lease yet is given
``HANDED_OUT_GRACES`` graces: a fresh process may spend seconds in its first
job before taking the lease (issue 23 item 7: an uploader importing torch for
3.4 s at a 5 s lease re-extracted a batch). A worker that died there is still
caught, one lease later.

A run no one may enqueue is left alone, whoever reconciles (issue 29 item 5): one planned only
(``hsx produce --no-enqueue``, until the user starts it), one being reset, one whose producer is
writing the plan (it holds the producer lock), one with no manifest. The pass's write is one
transaction that WATCHes those keys, so a reset or a plan-only mark that lands during the pass
aborts it rather than enqueueing a run being removed.

Workers and uploaders call ``maybe_reconcile`` from their heartbeats; a Redis
lock (SET NX PX ``interval``) lets one process per run make one pass per
``interval``. Worst case from orphaning to re-enqueue: ``2 * interval +
grace`` plus one heartbeat. Cost of a pass: one pipelined read (plan ids,
done ids, dead ids, leases, queue lists) and one pipelined write of the
re-enqueued jobs; nothing at all once the run is complete. Times are Redis
TIME (bench/reconcile_bench.py measures a 20k-batch run).
"""

from __future__ import annotations

import logging

import redis

from hsx.life import batchlife, leases, queues
from hsx.life.keys import RunKeys
from hsx.redisconn import text

log = logging.getLogger(__name__)
HANDED_OUT_GRACES = 3  # graces (lease / 2 each) a handed-out, not yet leased batch waits before it counts as lost


def _queue_names(r: redis.Redis, run: str) -> list[str]:
    hosts = [text(h) for h in r.hkeys(RunKeys(run).hosts)]
    return [queues.extract_queue_name(run)] + [queues.upload_queue_name(h) for h in hosts]


def handed_out(r: redis.Redis, run: str, bids: set[str]) -> set[str]:
    """Those of ``bids`` whose job rq has handed to a worker (intermediate list, started registry)."""
    if not bids:
        return set()
    pipe = r.pipeline(transaction=False)
    for name in _queue_names(r, run):
        q = queues.queue(r, name)
        pipe.lrange(q.intermediate_queue_key, 0, -1)
        pipe.zrange(q.started_job_registry.key, 0, -1)
    found = set()
    for ids in pipe.execute():
        for raw in ids:
            job_id = text(raw)  # started registry members are <job id>:<execution id>
            parsed = queues.batch_of_job(job_id) or queues.batch_of_job(job_id.rpartition(":")[0])
            if parsed and parsed[0] == run and parsed[1] in bids:
                found.add(parsed[1])
    return found


def orphans(r: redis.Redis, run: str) -> set[str]:
    """Planned batches already fed (hsx.life.batchlife.feed) neither done, queued, leased nor dead (one pipelined
    read + one of EXISTS)."""
    keys = RunKeys(run)
    queue_names = _queue_names(r, run)
    pipe = r.pipeline(transaction=False)
    pipe.hkeys(keys.plan)
    pipe.smembers(keys.done)
    pipe.hkeys(keys.dead)
    pipe.zrange(keys.extract_leases, 0, -1)
    pipe.zrange(keys.upload_leases, 0, -1)
    for name in queue_names:
        pipe.lrange(queues.queue(r, name).key, 0, -1)
    pipe.get(keys.fed)
    plan, done, dead, xl, ul, *lists, fed = pipe.execute()
    fed = None if fed is None else int(fed)
    left = {b for b in map(text, plan) if not batchlife.unfed(b, fed)} - {text(b) for b in done} - {text(b) for b in dead}
    left -= {text(b) for b in xl} | {text(b) for b in ul}
    if not left:
        return set()
    # A job id whose job hash was deleted by hand stays in the list until a worker pops and skips
    # it; from then on its batch is in no queue and the next passes catch it.
    for ids in lists:
        for raw in ids:
            parsed = queues.batch_of_job(text(raw))
            if parsed and parsed[0] == run:
                left.discard(parsed[1])
    return left


def _hands_off(keys: RunKeys) -> tuple[str, ...]:
    """Keys whose presence (or, for the manifest, absence) means no reconciler may enqueue the run."""
    return keys.producer_lock, keys.planned_only, keys.resetting, keys.manifest


def off_limits(r, run: str) -> str | None:
    """Why no reconciler may enqueue ``run`` now, or None: planned only, being reset, being planned, gone."""
    keys = RunKeys(run)
    # One EXISTS each: ``r`` may be a pipeline in WATCH mode, where commands run at once.
    lock, planned_only, resetting, manifest = (r.exists(k) for k in (keys.producer_lock, keys.planned_only,
                                                                     keys.resetting, keys.manifest))
    if resetting:
        return "being reset"
    if planned_only:
        return "planned only (hsx produce --no-enqueue)"
    if lock:
        return "a producer is planning / enqueueing it"
    if not manifest:
        return "not planned"
    return None


def reconcile(r: redis.Redis, run: str, grace: float) -> list[str]:
    """One pass: re-enqueue orphans first seen at least ``grace`` s ago; remember the new ones."""
    keys = RunKeys(run)
    if off_limits(r, run):
        return []
    total = int(r.hget(keys.totals, "batches") or 0)
    if total and r.scard(keys.done) >= total:
        r.delete(keys.orphans)
        return []
    now = leases.redis_now(r)
    found = orphans(r, run)
    seen = {text(k): float(v) for k, v in r.hgetall(keys.orphans).items()}
    waiting = handed_out(r, run, {b for b in found if b in seen and seen[b] <= now - grace})
    due = sorted(b for b in found if b in seen
                 and seen[b] <= now - grace * (HANDED_OUT_GRACES if b in waiting else 1))
    keep = {b: seen.get(b, now) for b in found if b not in due}
    with r.pipeline() as pipe:
        pipe.watch(*_hands_off(keys))
        if off_limits(pipe, run):  # marked while this pass read: nothing written
            return []
        pipe.multi()
        pipe.delete(keys.orphans)
        if keep:
            pipe.hset(keys.orphans, mapping=keep)
        if due:
            batchlife.enqueue(r, run, due, at_front=True, pipe=pipe)  # fresh job ids from one INCRBY
        try:
            pipe.execute()
        except redis.WatchError:
            return []  # reset, planned only or being planned since the read: the next pass looks again
    batchlife.feed(r, run)   # the queue topped up from the plan (nothing while it holds QUEUE_AHEAD jobs)
    if due:
        log.warning("reconciler: re-enqueued %d batches of run %s that were in no queue, lease or dead letter: %s",
                    len(due), run, due[:10])
    return due


def maybe_reconcile(r: redis.Redis, run: str, interval: float, grace: float | None = None) -> list[str] | None:
    """Make a pass if no process of any host made one in the last ``interval`` s; None if skipped."""
    if not r.set(RunKeys(run).reconcile_lock, "1", nx=True, px=max(int(interval * 1000), 1)):
        return None
    return reconcile(r, run, interval if grace is None else grace)
