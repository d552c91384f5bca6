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
job before taking the lease (an uploader importing torch for
3.4 s at a 5 s lease re-extracted a batch). A worker that died there is still
caught, one lease later.

A run no one may enqueue is left alone, whoever reconciles: one planned only
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

from hsx.life import batchlife, doneledger, leases, ledger, queues
from hsx.life.keys import RunKeys
from hsx.redisconn import text
from hsx.store import layout

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


RECONCILE_CHUNK = 4096  # batches a pass checks of a run fed in steps, besides the last 2 x QUEUE_AHEAD fed

# KEYS: plan, done prefix, dead, extract_leases, upload_leases ; ARGV: batch ids
# Those of the ids planned and neither done, dead nor leased (each check O(1): the script is O(ids)).
_UNACCOUNTED = doneledger.LUA_DONE + """
local out = {}
for _, bid in ipairs(ARGV) do
  if redis.call('HEXISTS', KEYS[1], bid) == 1 and not is_done(KEYS[2], bid)
     and redis.call('HEXISTS', KEYS[3], bid) == 0 and not redis.call('ZSCORE', KEYS[4], bid)
     and not redis.call('ZSCORE', KEYS[5], bid) then
    out[#out + 1] = bid
  end
end
return out
"""


def _fed_candidates(r: redis.Redis, run: str, fed: int, advance: bool) -> list[str]:
    """The batch ids a pass checks of a run fed in steps: the last 2 x QUEUE_AHEAD fed (where hand-overs happen),
    and the next RECONCILE_CHUNK from the run's reconcile cursor, which (``advance``) goes round [0, fed) pass by
    pass: every fed batch is checked within fed / RECONCILE_CHUNK passes, and no pass reads an O(run) key."""
    recent = set(range(max(fed - 2 * batchlife.QUEUE_AHEAD, 0), fed))
    start = int(r.get(RunKeys(run).reconcile_cursor) or 0)
    start = start if start < fed else 0
    end = min(start + RECONCILE_CHUNK, fed)
    if advance:
        r.set(RunKeys(run).reconcile_cursor, end if end < fed else 0)
    return [layout.batch_id(i) for i in sorted(recent | set(range(start, end)))]


def orphans(r: redis.Redis, run: str, also=(), advance: bool = False, whole: bool = False) -> set[str]:
    """Planned batches already fed (hsx.life.batchlife.feed) neither done, queued, leased nor dead. A run fed in
    steps: among the batches ``_fed_candidates`` names and ``also`` (one script, O(candidates), and the queues'
    lists, O(jobs queued)); ``advance``: the reconcile cursor moves on (a pass); ``whole``: every fed batch (`hsx
    verify --repair`, in scripts of 256). An older hsx's run: all of them (one pipelined read of the plan, the
    ledger, the leases)."""
    keys = RunKeys(run)
    fed = batchlife.fed_count(r, run)
    if fed is not None:
        ids = ([layout.batch_id(i) for i in range(fed)] if whole
               else sorted(set(_fed_candidates(r, run, fed, advance)) | set(also)))
        left = {text(b) for start in range(0, len(ids), 256) for b in r.eval(   # ~0.5 ms of Redis a script
            _UNACCOUNTED, 5, keys.plan, keys.done_prefix, keys.dead, keys.extract_leases, keys.upload_leases,
            *ids[start:start + 256])}
        return _not_queued(r, run, left)
    queue_names = _queue_names(r, run)
    pipe = r.pipeline(transaction=False)
    pipe.hkeys(keys.plan)
    pipe.hkeys(keys.dead)
    pipe.zrange(keys.extract_leases, 0, -1)
    pipe.zrange(keys.upload_leases, 0, -1)
    for name in queue_names:
        pipe.lrange(queues.queue(r, name).key, 0, -1)
    plan, dead, xl, ul, *lists = pipe.execute()
    left = {text(b) for b in plan} - ledger.done_ids(r, run) - {text(b) for b in dead}
    left -= {text(b) for b in xl} | {text(b) for b in ul}
    return _discard_listed(run, left, lists)


def _not_queued(r: redis.Redis, run: str, left: set[str]) -> set[str]:
    """Those of ``left`` no queue of the run lists (one pipelined LRANGE a queue)."""
    if not left:
        return set()
    pipe = r.pipeline(transaction=False)
    for name in _queue_names(r, run):
        pipe.lrange(queues.queue(r, name).key, 0, -1)
    return _discard_listed(run, left, pipe.execute())


def _discard_listed(run: str, left: set[str], lists) -> set[str]:
    # A job id whose job hash was deleted by hand stays in the list until a worker pops and skips
    # it; from then on its batch is in no queue and the next passes catch it.
    if not left:
        return set()
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
    lock, planned_only, resetting, manifest, old = (r.exists(k) for k in (
        keys.producer_lock, keys.planned_only, keys.resetting, keys.manifest, keys.done))
    if resetting:
        return "being reset"
    if planned_only:
        return "planned only (hsx produce --no-enqueue)"
    if lock:
        return "a producer is planning / enqueueing it"
    if not manifest:
        return "not planned"
    if old:
        return "its done ledger is an older hsx's (`hsx produce` converts it)"
    return None


def reconcile(r: redis.Redis, run: str, grace: float) -> list[str]:
    """One pass: re-enqueue orphans first seen at least ``grace`` s ago; remember the new ones."""
    keys = RunKeys(run)
    if off_limits(r, run):
        return []
    total = int(r.hget(keys.totals, "batches") or 0)
    if total and ledger.done_count(r, run) >= total:
        r.delete(keys.orphans)
        return []
    now = leases.redis_now(r)
    seen = {text(k): float(v) for k, v in r.hgetall(keys.orphans).items()}   # O(orphans), not O(run)
    found = orphans(r, run, also=seen, advance=True)   # the ones seen before are checked again
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
