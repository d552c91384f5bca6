"""A batch's life in Redis: its states, and the one function per transition that writes them.

Every change of a batch's state, by either role, the reconciler or the CLI, goes through a
function here; nothing else in hsx writes a batch's queue jobs, leases, failure or dead-letter
records (tests/test_batchlife.py checks the callers), bar two writes that change no state: a
heartbeat pushing its leases' expiry forward, and ``ledger.drop_failures_of_done``. Each function writes its keys in one
pipeline or one script, as the ledger primitives it builds on (``hsx.life.ledger``,
``hsx.life.leases``) do.

State       What marks it in Redis (``hsx:<run>:`` keys, rq queues)
----------  ------------------------------------------------------------------------------------
planned     a ``plan`` entry, an ``x-<run>-<batch>-<seq>`` job on ``extract:<run>`` (or none: an
            orphan the reconciler queues again)
leased      ``extract_leases`` member: a GPU worker computes it (expiry on Redis' clock)
spooled     its file in a host's spool, a ``u-<run>-<batch>-<seq>`` job on ``upload@<host>``;
            first time only: ``spooled_log``
uploading   ``upload_leases`` member + ``upload_jobs`` entry: an uploader holds it
done        ``done`` member (+ ``done_info``, counters, ``done_seq``, ``done_log``): verified in the store
failed      a ``failures`` record {attempts, last_error, ts} (attempts < max) and queued again
dead        a ``dead`` record: needs a person (``hsx retry-failed``, the dashboard)

Transition                          Function            Who
----------------------------------  ------------------  ----------------------------------------------
-> planned                          ``enqueue``         producer; reconciler (orphans); ``verify --repair``
planned | failed | dead -> leased   ``lease``           GPU worker (a done batch: IllegalTransition)
leased -> planned (uncounted)       ``hand_back``       a worker stopping, or one that lost the store
leased -> (as it was)               ``release``         a worker letting go (done, or ``fail`` follows)
leased -> spooled                   ``spool``           GPU worker's writer (clears the failure record)
spooled -> uploading -> (exit)      ``uploading``       uploader (a context: the lease held inside it)
uploading | spooled -> spooled      ``requeue_upload``  uploader (store trouble, refused here); restart
uploading -> done                   ``finish``          uploader; the ledger rebuilt from the store
leased | uploading -> failed | dead ``fail``            GPU worker, uploader, ``reap`` (a dead letter at
                                                        the run's max_attempts; a done batch: nothing)
expired lease -> failed | spooled   ``reap``            every heartbeat (extract -> ``fail``, upload ->
                                                        ``requeue_upload``)
dead -> planned | spooled          ``retry``           ``hsx retry-failed``, the dashboard (else NotRetryable);
                                                        spooled: a kept spool file (``kept_uploads``) uploaded again
done -> planned                     ``reopen``          ``verify --repair``, ``produce`` (object missing or bad)

A job id's last part (``<seq>``) only makes it unique: the first job of a batch has 1, every later one
a fresh number from ``next_seqs`` (one INCRBY), so a new job never overwrites one a dead process may
still hold.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import NamedTuple

import redis

from hsx.errors import HsxError
from hsx.life import heartbeat, leases, ledger, queues
from hsx.life.keys import RunKeys
from hsx.redisconn import text

log = logging.getLogger(__name__)
FIRST_SEQ = 1          # job-id suffix of a batch's first extract job (the producer's)
SEQ_BASE = 1000        # later suffixes are SEQ_BASE + the run's job_seq counter


class State(str, Enum):
    PLANNED = "planned"
    LEASED = "leased"
    SPOOLED = "spooled"
    UPLOADING = "uploading"
    DONE = "done"
    FAILED = "failed"
    DEAD = "dead"


class IllegalTransition(HsxError):
    """A transition the batch's state does not allow (e.g. done -> leased); nothing was written."""

    def __init__(self, run: str, bid: str, state: State, to: State):
        super().__init__(f"batch {bid} of run {run} is {state.value}; it cannot become {to.value}")
        self.state, self.to = state, to


class NotRetryable(HsxError):
    """A batch named for retry is not in the plan, or not a dead letter; nothing was changed."""


class Failure(NamedTuple):
    state: State       # FAILED (queued again), DEAD (a dead letter) or DONE (nothing counted)
    attempts: int      # failures counted so far (0: the batch was done)


def next_seqs(r: redis.Redis, run: str, count: int = 1) -> range:
    """``count`` fresh job-id suffixes (one INCRBY): re-enqueued jobs never reuse an id a dead worker may hold."""
    last = SEQ_BASE + int(r.incrby(RunKeys(run).job_seq, count))
    return range(last - count + 1, last + 1)


def state_of(r: redis.Redis, run: str, bid: str) -> State | None:
    """What Redis says of ``bid`` now (None: not in the plan), for tests and diagnosis: each transition
    checks what it must inside its own write."""
    keys = RunKeys(run)
    pipe = r.pipeline(transaction=False)
    pipe.hexists(keys.plan, bid)
    pipe.sismember(keys.done, bid)
    pipe.hexists(keys.dead, bid)
    pipe.zscore(keys.upload_leases, bid)
    pipe.zscore(keys.extract_leases, bid)
    pipe.hexists(keys.failures, bid)
    planned, done, dead, uploading, leased, failed = pipe.execute()
    if not planned:
        return None
    for held, state in ((done, State.DONE), (dead, State.DEAD), (uploading is not None, State.UPLOADING),
                        (leased is not None, State.LEASED)):
        if held:
            return state
    upload_queues = [text(n).removeprefix("rq:queue:") for n in r.smembers("rq:queues")]
    if any(bid in queues.queued_batches(r, name, run) for name in upload_queues if name.startswith("upload@")):
        return State.SPOOLED
    return State.FAILED if failed else State.PLANNED


# ---- planned ---------------------------------------------------------------------------------------
def enqueue(r: redis.Redis, run: str, bids: list[str], at_front: bool = False, first: bool = False, pipe=None) -> None:
    """-> planned: an extract job for each of ``bids``. ``first``: the producer's first jobs (suffix 1, no
    Redis call, so they fit its guarded transaction); else fresh suffixes. ``at_front``: work taken back,
    next in line already. Written in ``pipe`` if given (the caller executes it), else in one pipeline."""
    if not bids:
        return
    seqs = [FIRST_SEQ] * len(bids) if first else next_seqs(r, run, len(bids))
    p = pipe if pipe is not None else r.pipeline()
    for bid, seq in zip(bids, seqs, strict=True):
        queues.enqueue_extract(r, run, bid, seq, pipeline=p, at_front=at_front)
    if pipe is None:
        p.execute()


# ---- leased ----------------------------------------------------------------------------------------
# KEYS: done, plan, extract_leases ; ARGV: batch_id, lease_seconds
# Returns {'done'} (nothing written), {'unplanned'} (nothing written) or {'leased', <spec JSON>} with the
# lease's expiry at Redis TIME + lease_seconds.
_LEASE = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return {'done'} end
local spec = redis.call('HGET', KEYS[2], ARGV[1])
if not spec then return {'unplanned'} end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2]), ARGV[1])
return {'leased', spec}
"""


def lease(r: redis.Redis, run: str, bid: str, lease_seconds: float) -> ledger.BatchSpec | None:
    """planned | failed | dead -> leased, in one script: the batch's spec, or None if it is not in the plan.
    A done batch is refused (IllegalTransition, state DONE): a duplicate delivery has nothing to compute."""
    keys = RunKeys(run)
    found = r.eval(_LEASE, 3, keys.done, keys.plan, keys.extract_leases, bid, lease_seconds)
    outcome = text(found[0])
    if outcome == "done":
        raise IllegalTransition(run, bid, State.DONE, State.LEASED)
    return ledger.BatchSpec.from_json(found[1]) if outcome == "leased" else None


def release(r: redis.Redis, run: str, bid: str) -> None:
    """A worker lets go of its extract lease with no state change of its own: the batch turned out done,
    or ``fail`` counts its failure next."""
    leases.drop(r, RunKeys(run).extract_leases, bid)


def hand_back(r: redis.Redis, run: str, bid: str, leased: bool = True) -> bool:
    """leased -> planned, no failure counted, queued at the front. ``leased``: only if this process still
    holds the lease (a reaper that took it first queued it already). True if queued."""
    if leased and not r.zrem(RunKeys(run).extract_leases, bid):
        return False
    enqueue(r, run, [bid], at_front=True)
    return True


# ---- spooled and uploading -------------------------------------------------------------------------
def spool(r: redis.Redis, run: str, bid: str, host: str, path: str, size: int, sha256: str, tier: str, pipe) -> None:
    """leased -> spooled: the upload job (a job id of its own: a second extraction of the batch must not
    overwrite an upload job still running), the spool log and bytes, the failure record cleared, the
    extract lease dropped; in ``pipe`` (a MULTI pipeline the caller executes, with its own writes)."""
    keys = RunKeys(run)
    queues.enqueue_upload(r, host, run, bid, path, size, sha256, next_seqs(r, run)[0], pipeline=pipe, tier=tier)
    ledger.mark_spooled(r, run, bid, pipe=pipe, nbytes=size)
    ledger.clear_failure(r, run, bid, pipe=pipe)
    leases.drop(r, keys.extract_leases, bid, pipe=pipe)


def requeue_upload(r: redis.Redis, host: str, run: str, bid: str, path: str, size: int, sha256: str, tier: str,
                   retry: int = 0, at_front: bool = False) -> None:
    """uploading | spooled -> spooled: a new upload job for the spool file (fresh job id). ``retry`` counts
    store failures of this upload (the uploader's backoff)."""
    queues.enqueue_upload(r, host, run, bid, path, size, sha256, next_seqs(r, run)[0], retry=retry,
                          at_front=at_front, tier=tier)


@contextmanager
def uploading(r: redis.Redis, run: str, bid: str, job: dict, lease_seconds: float) -> Iterator[None]:
    """spooled -> uploading while inside (the upload lease and the job to re-enqueue if its holder dies);
    on the way out, whatever happened, the lease goes (``finish``, ``fail`` or ``requeue_upload`` said
    where the batch goes next)."""
    keys = RunKeys(run)
    pipe = r.pipeline()
    pipe.hset(keys.upload_jobs, bid, json.dumps(job))
    leases.take(r, keys.upload_leases, bid, lease_seconds, pipe=pipe)
    pipe.execute()
    try:
        yield
    finally:
        pipe = r.pipeline()
        pipe.zrem(keys.upload_leases, bid)
        pipe.hdel(keys.upload_jobs, bid)
        pipe.execute()


# ---- done ------------------------------------------------------------------------------------------
def finish(r: redis.Redis, run: str, spec: ledger.BatchSpec, key: str, size: int, sha256: str, by: str) -> bool:
    """-> done. Call only after the store verified the object: the last write. True if newly recorded
    (a batch done already stays as it is; its failure and dead-letter records go either way)."""
    return ledger.mark_done(r, run, spec, key, size, sha256, by)


def reopen(r: redis.Redis, run: str, spec: ledger.BatchSpec, requeue: bool = True) -> bool:
    """done -> planned: its object is missing or bad. Out of the ledger (counters, index marker), no dead
    letter left, and (``requeue``) queued at the front. False, nothing written, if it was not done."""
    if not ledger.unmark_done(r, run, spec):
        return False
    ledger.take_dead_letters(r, run, [spec.batch_id])
    if requeue:
        enqueue(r, run, [spec.batch_id], at_front=True)
    return True


# ---- failed and dead -------------------------------------------------------------------------------
def fail(r: redis.Redis, run: str, bid: str, error: str, max_attempts: int, requeue: bool = True,
         at_front: bool = False, kept_upload: dict | None = None) -> Failure:
    """leased | uploading -> failed | dead: count a failure (one script); below the run's ``max_attempts``
    the batch is extracted again (``requeue``; False: the caller queues its own next try), at it a dead
    letter. A done batch counts nothing (a late failure of a duplicate copy is no failure of the batch).
    ``kept_upload``: the upload job of a spool file kept (host, path, size, sha256, tier): a dead letter
    then remembers it, and ``retry`` uploads that file again instead of extracting the batch anew."""
    attempts = ledger.record_failure(r, run, bid, error, max_attempts)
    if attempts == 0:
        return Failure(State.DONE, 0)
    if attempts >= max_attempts:
        if kept_upload is not None:
            r.hset(RunKeys(run).kept_uploads, bid, json.dumps(kept_upload))
        log.error("batch %s of run %s failed %d times; moved to dead letters: %s", bid, run, attempts, error)
        return Failure(State.DEAD, attempts)
    if requeue:
        enqueue(r, run, [bid], at_front=at_front)
    log.warning("batch %s of run %s failed (attempt %d/%d)%s: %s", bid, run, attempts, max_attempts,
                ", re-enqueued" if requeue else "", error)
    return Failure(State.FAILED, attempts)


def reap(r: redis.Redis, run: str, max_attempts: int, now: float | None = None) -> dict[str, list[str]]:
    """Batches whose lease expired (``now``: Redis TIME unless given): an extract lease is a lost worker
    (``fail``, at the front), an upload lease a lost uploader (``requeue_upload`` at the front). ZREM
    decides which reaper wins, so each is taken back once. Returns {"extract": [...], "upload": [...]}."""
    keys = RunKeys(run)
    now = leases.redis_now(r) if now is None else now
    reclaimed: dict[str, list[str]] = {"extract": [], "upload": []}
    for raw in r.zrangebyscore(keys.extract_leases, "-inf", now):
        bid = text(raw)
        if not r.zrem(keys.extract_leases, bid):
            continue  # another reaper took it, or it was refreshed and dropped meanwhile
        holder = heartbeat.last_holder(r, run, bid)
        why = f"worker lost: {holder} stopped beating while it held the batch" if holder else "worker lost"
        if fail(r, run, bid, f"{why} (lease expired without heartbeat); reclaimed", max_attempts,
                at_front=True).attempts:
            reclaimed["extract"].append(bid)
    for raw in r.zrangebyscore(keys.upload_leases, "-inf", now):
        bid = text(raw)
        if not r.zrem(keys.upload_leases, bid):
            continue
        job = r.hget(keys.upload_jobs, bid)
        r.hdel(keys.upload_jobs, bid)
        if job is None or ledger.is_done(r, run, bid):
            continue
        kw = json.loads(job)
        requeue_upload(r, kw["host"], run, bid, kw["path"], kw["size"], kw["sha256"], kw.get("tier", "disk"),
                       at_front=True)
        reclaimed["upload"].append(bid)
    for kind, bids in reclaimed.items():
        if bids:
            log.warning("reclaimed %d %s batches of run %s from dead processes: %s", len(bids), kind, run, bids[:10])
    return reclaimed


def retry(r: redis.Redis, run: str, bids: list[str] | None = None) -> list[str]:
    """dead -> planned: dead letters (all, or ``bids``) back on the extract queue, failure count reset.

    Every id in ``bids`` must be a planned batch in the dead-letter record, else NotRetryable says
    which and why, and nothing is changed.
    """
    if bids is not None:
        planned = r.hmget(RunKeys(run).plan, bids) if bids else []
        unknown = [bid for bid, raw in zip(bids, planned, strict=False) if raw is None]
        if unknown:
            raise NotRetryable(f"not in the plan of run {run!r}: {', '.join(unknown[:10])}"
                               f"{' ...' if len(unknown) > 10 else ''}; nothing was retried")
        dead = ledger.dead_letters(r, run)
        alive = [bid for bid in bids if bid not in dead]
        if alive:
            why = ", ".join(f"{bid} ({'done' if ledger.is_done(r, run, bid) else 'not failed for good'})"
                            for bid in alive[:10])
            hint = (f" (a done batch whose object is bad is re-extracted by `hsx verify --run {run} --repair`)"
                    if any(ledger.is_done(r, run, bid) for bid in alive) else "")
            raise NotRetryable(f"not dead letters of run {run!r}: {why}; nothing was retried{hint}")
    taken = ledger.take_dead_letters(r, run, bids)
    keys, extract = RunKeys(run), []
    for bid in taken:
        if ledger.is_done(r, run, bid):
            continue
        kept = r.hget(keys.kept_uploads, bid)
        r.hdel(keys.kept_uploads, bid)
        if kept is None:
            extract.append(bid)
            continue
        # Its spool file was kept: upload it again (a file gone by then fails as lost, and is extracted again).
        job = json.loads(kept)
        requeue_upload(r, job["host"], run, bid, job["path"], job["size"], job["sha256"], job.get("tier", "disk"))
    enqueue(r, run, extract)
    return taken
