"""A batch's life in Redis: its states, and the one function per transition that writes them.

Every change of a batch's state, by either role, the reconciler or the CLI, goes through a
function here; nothing else in hsx writes a batch's queue jobs, leases, failure or dead-letter
records (tests/test_batchlife.py checks the callers' syntax trees), bar two writes that change no state: a
heartbeat pushing its leases' expiry forward, and ``ledger.drop_failures_of_done``. The decisions a role
would otherwise make are here too: what each kind of upload failure does (``upload_failed`` applies the
row of ``uploadpolicy.UPLOAD_FAILURES``), and whether a computed batch is done already (``release_if_done``).

Most functions write their keys in one pipeline or one script, as the ledger primitives they build on
(``hsx.life.ledger``, ``hsx.life.leases``) do; a new job's id costs one INCRBY before it (``next_seqs``).
Where a later write depends on what an earlier one found (no script can make an rq job, and a MULTI
cannot branch), there are more, exactly these; a process dying between them leaves a batch the
reconciler queues again (an orphan) or a lease the reaper takes back, never a batch lost:

- ``fail``: one script counts the failure (the dead letter, with its kept spool file, in it), then the
  error log line (advisory) and, below the limit, the new job's pipeline;
- ``hand_back``: the lease's ZREM (only its holder queues it), then the job's pipeline;
- ``reopen``: the ledger's script, then one pipeline (the dead letter dropped, the job queued);
- ``reap``: per expired lease, a ZREM decides the one reaper, then ``fail`` or the upload job's HGET/HDEL
  and ``requeue_upload``;
- ``retry``: the dead letters taken (one pipeline), then per kept spool file its record and new upload
  job, then one enqueue of the rest;
- ``upload_failed``: ``fail`` as above, then (after the backoff) ``requeue_upload``;
- ``withdraw``: one script per ``WITHDRAW_CHUNK`` jobs (each leaves the plan and its totals agreeing).

State       What marks it in Redis (``hsx:<run>:`` keys, rq queues)
----------  ------------------------------------------------------------------------------------
planned     a ``plan`` entry, an ``x-<run>-<batch>-<seq>`` job on ``extract:<run>`` (or none: not fed
            yet, its index at or past ``fed``; else an orphan the reconciler queues again)
leased      ``extract_leases`` member: a GPU worker computes it (expiry on Redis' clock)
spooled     its file in a host's spool, a ``u-<run>-<batch>-<seq>`` job on ``upload@<host>``;
            first time only: ``spooled_log``
uploading   ``upload_leases`` member + ``upload_jobs`` entry: an uploader holds it
done        a record in its ``done:<chunk>`` hash (hsx/life/doneledger.py; + counters, ``done_seq``,
            ``done_log``): verified in the store
failed      a ``failures`` record {attempts, last_error, ts} (attempts < max) and queued again
dead        a ``dead`` record: needs a person (``hsx retry-failed``, the dashboard)

Transition                          Function            Who
----------------------------------  ------------------  ----------------------------------------------
-> planned                          ``enqueue``         producer; reconciler (orphans); ``verify --repair``
-> planned, QUEUE_AHEAD at a time   ``feed``            producer (each window), ``lease`` (a queue run low),
                                                        the reconciler (each pass)
planned | failed | dead -> leased   ``lease``           GPU worker (a done batch: IllegalTransition)
leased -> planned (uncounted)       ``hand_back``       a worker stopping, or one that lost the store
leased -> (as it was)               ``release``         a worker letting go (done, or ``fail`` follows)
leased -> spooled                   ``spool``           GPU worker's writer (clears the failure record)
leased -> done, if done already     ``release_if_done`` GPU worker's writer (a duplicate delivery: one script)
spooled -> uploading -> (exit)      ``uploading``       uploader (a context: the lease held inside it)
uploading | spooled -> spooled      ``requeue_upload``  a worker restart (spool files left); ``reap``
uploading -> done                   ``finish``          uploader; the ledger rebuilt from the store
leased | uploading -> failed | dead ``fail``            GPU worker, uploader, ``reap`` (a dead letter at
                                                        the run's max_attempts; a done batch: nothing)
uploading | spooled -> failed |     ``upload_failed``   uploader: its row of ``UPLOAD_FAILURES`` (count,
  dead | spooled                                        extract again or dead-letter, upload again after
                                                        the backoff, or put back untouched)
planned -> (out of the plan)        ``withdraw``        ``produce`` (a plan taken back: queued jobs only)
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

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import NamedTuple

import redis
from rq.job import Job

from hsx.defaults import QUEUE_AHEAD
from hsx.errors import HsxError
from hsx.life import doneledger, heartbeat, leases, ledger, oldledger, queues
from hsx.life.keys import RunKeys
from hsx.life.queues import UploadJob
from hsx.life.uploadpolicy import UPLOAD_FAILURES, UploadFailure, upload_backoff
from hsx.redisconn import text
from hsx.store import layout

log = logging.getLogger(__name__)
FIRST_SEQ = 1          # job-id suffix of a batch's first extract job (the producer's)
SEQ_BASE = 1000        # later suffixes are SEQ_BASE + the run's job_seq counter
WITHDRAW_CHUNK = 1000  # extract jobs withdrawn in one script (Redis does nothing else meanwhile)


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
    pipe.hstrlen(keys.done_chunk(doneledger.slot(bid)[0]), doneledger.slot(bid)[1])
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


# KEYS: fed, extract queue, planned_only, resetting, totals ; ARGV: ahead (jobs), limit (batches; -1: the totals')
# Claims the next batches to feed: as many as the queue lacks of ``ahead``, up to ``limit``. Returns {first, count}
# ({0, 0}: nothing to feed: a run planned only, being reset, or not fed in steps, an older hsx's, which has no fed).
_FEED = """
if redis.call('EXISTS', KEYS[3]) == 1 or redis.call('EXISTS', KEYS[4]) == 1 then return {0, 0} end
local fed = redis.call('GET', KEYS[1])
if not fed then return {0, 0} end
fed = tonumber(fed)
local limit = tonumber(ARGV[2])
if limit < 0 then limit = tonumber(redis.call('HGET', KEYS[5], 'batches') or '0') end
local take = math.min(tonumber(ARGV[1]) - redis.call('LLEN', KEYS[2]), limit - fed)
if take <= 0 then return {fed, 0} end
redis.call('SET', KEYS[1], fed + take)
return {fed, take}
"""


def start_feeding(r: redis.Redis, run: str) -> None:
    """A new run is fed to its extract queue in steps (``feed``) from its first batch on (SET NX: a run already
    fed keeps its place; a run an older hsx planned, whose every batch was queued, never gets one)."""
    r.set(RunKeys(run).fed, 0, nx=True)


def fed_count(r: redis.Redis, run: str) -> int | None:
    """Batches 0 .. n-1 of the run were given their first extract job; None: every planned batch was (a run planned
    by an hsx before the queue was fed in steps)."""
    raw = r.get(RunKeys(run).fed)
    return None if raw is None else int(raw)


def feed(r: redis.Redis, run: str, limit: int | None = None, ahead: int | None = None, pipe=None) -> int:
    """-> planned, in steps: the next batches of the plan (those not done) get their first extract job, as many as
    the queue lacks of ``ahead`` jobs, up to batch ``limit`` (None: the planned total of the run's whole windows).
    The producer feeds after each window; every lease tops the queue up when it is below half of ``ahead``, and
    the reconciler does in each pass. The claim is one script (a fed batch is claimed once); a process dying
    after it leaves orphans the reconciler queues again. Written in ``pipe`` if given (the caller executes it).
    Returns the jobs queued. ``ahead``: QUEUE_AHEAD unless given."""
    keys = RunKeys(run)
    ahead = QUEUE_AHEAD if ahead is None else ahead
    first, count = (int(x) for x in r.eval(_FEED, 5, keys.fed, queues.queue(r, queues.extract_queue_name(run)).key,
                                             keys.planned_only, keys.resetting, keys.totals, ahead,
                                             -1 if limit is None else limit))
    if not count:
        return 0
    bids = [layout.batch_id(i) for i in range(first, first + count)]
    done = ledger.done_among(r, run, bids)   # one pipeline of HMGETs (a hundred batches each) for the whole step
    todo = [b for b in bids if b not in done]
    enqueue(r, run, todo, first=True, pipe=pipe)
    return len(todo)


def unfed(bid: str, fed: int | None) -> bool:
    """``bid`` has not been given its first job yet (its index is at or past ``fed``; an older run's never)."""
    return fed is not None and bid[1:].isdigit() and int(bid[1:]) >= fed


# KEYS: extract queue, plan, done prefix, windows, totals, then each job's rq hash ; ARGV: job id, batch id (pairs)
# Each job still queued (LREM found it: no worker took it) goes, its hash too, and its batch leaves the plan unless
# done; then the window records go and the totals count the plan again. Returns how many jobs went.
_WITHDRAW = doneledger.LUA_DONE + """
local withdrawn = 0
for i = 1, #ARGV, 2 do
  if redis.call('LREM', KEYS[1], 1, ARGV[i]) == 1 then
    redis.call('DEL', KEYS[5 + (i + 1) / 2])
    if not is_done(KEYS[3], ARGV[i + 1]) then redis.call('HDEL', KEYS[2], ARGV[i + 1]) end
    withdrawn = withdrawn + 1
  end
end
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[5], 'batches', redis.call('HLEN', KEYS[2]), 'planning', 1)
return withdrawn
"""


def withdraw(r: redis.Redis, run: str) -> int:
    """planned -> out of the plan: every queued (not started) extract job of ``run`` off the queue and its batch
    out of the plan (a done batch keeps its entry); the window records forgotten and the totals counted again
    (planning), so a re-run plans again from the first window. Batches running or done stay. One script per
    ``WITHDRAW_CHUNK`` jobs. Returns the number of jobs withdrawn."""
    keys = RunKeys(run)
    q = queues.queue(r, queues.extract_queue_name(run))
    ours = [(job_id, parsed[1]) for job_id in q.get_job_ids()
            if (parsed := queues.batch_of_job(job_id)) and parsed[0] == run]
    withdrawn = 0
    for start in range(0, max(len(ours), 1), WITHDRAW_CHUNK):
        chunk = ours[start:start + WITHDRAW_CHUNK]
        withdrawn += int(r.eval(_WITHDRAW, 5 + len(chunk), q.key, keys.plan, keys.done_prefix, keys.windows, keys.totals,
                                *(Job.key_for(job_id) for job_id, _ in chunk),
                                *(part for pair in chunk for part in pair)))
    fed = fed_count(r, run)
    if fed is not None:  # batches not fed yet have no job to take back: they leave the plan too (unless done)
        later = [text(b) for b in r.hkeys(keys.plan) if unfed(text(b), fed)]
        settled = ledger.done_among(r, run, later)   # once (it was asked again for each batch)
        later = [b for b in later if b not in settled]
        for start in range(0, len(later), WITHDRAW_CHUNK):
            r.hdel(keys.plan, *later[start:start + WITHDRAW_CHUNK])
        if later:
            r.hset(keys.totals, mapping={"batches": r.hlen(keys.plan), "planning": 1})
    return withdrawn


# ---- leased ----------------------------------------------------------------------------------------
# KEYS: done prefix, plan, extract_leases, extract queue, the old ledger's done SET ; ARGV: batch_id, lease_seconds
# Returns {'done', <queue length>} (nothing written), {'unplanned', <queue length>} (nothing written), {'old', 0}
# (nothing written: a run whose ledger an older hsx wrote) or {'leased', <spec JSON>, <queue length>} with
# the lease's expiry at Redis TIME + lease_seconds.
_LEASE = doneledger.LUA_DONE + """
if redis.call('EXISTS', KEYS[5]) == 1 then return {'old', 0} end
if is_done(KEYS[1], ARGV[1]) then return {'done', redis.call('LLEN', KEYS[4])} end
local spec = redis.call('HGET', KEYS[2], ARGV[1])
if not spec then return {'unplanned', redis.call('LLEN', KEYS[4])} end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2]), ARGV[1])
return {'leased', spec, redis.call('LLEN', KEYS[4])}
"""


def lease(r: redis.Redis, run: str, bid: str, lease_seconds: float) -> ledger.BatchSpec | None:
    """planned | failed | dead -> leased, in one script: the batch's spec, or None if it is not in the plan.
    A done batch is refused (IllegalTransition, state DONE): a duplicate delivery has nothing to compute."""
    keys = RunKeys(run)
    found = r.eval(_LEASE, 5, keys.done_prefix, keys.plan, keys.extract_leases,
                   queues.queue(r, queues.extract_queue_name(run)).key, keys.done, bid, lease_seconds)
    outcome = text(found[0])
    if outcome == "old":
        raise oldledger.OldLedger(oldledger.why_old(run))
    if int(found[-1]) < QUEUE_AHEAD // 2:   # the queue runs low: top it up from the plan (whatever this job was)
        feed(r, run)
    if outcome == "done":
        raise IllegalTransition(run, bid, State.DONE, State.LEASED)
    return ledger.BatchSpec.from_json(found[1], bid) if outcome == "leased" else None


def release(r: redis.Redis, run: str, bid: str) -> None:
    """A worker lets go of its extract lease with no state change of its own: the batch turned out done,
    or ``fail`` counts its failure next."""
    leases.drop(r, RunKeys(run).extract_leases, bid)


# KEYS: done prefix, extract_leases ; ARGV: batch_id. Returns 1 (and drops the lease) if the batch is done, else 0.
_RELEASE_IF_DONE = doneledger.LUA_DONE + """
if not is_done(KEYS[1], ARGV[1]) then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""


def release_if_done(r: redis.Redis, run: str, bid: str) -> bool:
    """A computed batch that is done already (a duplicate delivery finished elsewhere first): its extract
    lease dropped and True, in one script; nothing to write then. False, nothing written: go on and spool it."""
    keys = RunKeys(run)
    return bool(r.eval(_RELEASE_IF_DONE, 2, keys.done_prefix, keys.extract_leases, bid))


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
    job = UploadJob(host, path, size, sha256, tier)
    queues.enqueue_upload_job(r, run, bid, job, next_seqs(r, run)[0], pipeline=pipe)
    ledger.mark_spooled(r, run, bid, pipe=pipe, nbytes=size)
    ledger.clear_failure(r, run, bid, pipe=pipe)
    leases.drop(r, keys.extract_leases, bid, pipe=pipe)


def requeue_upload(r: redis.Redis, host: str, run: str, bid: str, path: str, size: int, sha256: str, tier: str,
                   retry: int = 0, at_front: bool = False) -> None:
    """uploading | spooled -> spooled: a new upload job for the spool file (fresh job id). ``retry`` counts
    store failures of this upload (the uploader's backoff)."""
    _upload_again(r, run, bid, UploadJob(host, path, size, sha256, tier), retry, at_front)


def _upload_again(r: redis.Redis, run: str, bid: str, job: UploadJob, retry: int = 0, at_front: bool = False) -> None:
    queues.enqueue_upload_job(r, run, bid, job, next_seqs(r, run)[0], retry=retry, at_front=at_front)


@contextmanager
def uploading(r: redis.Redis, run: str, bid: str, job: UploadJob, lease_seconds: float) -> Iterator[None]:
    """spooled -> uploading while inside (the upload lease and the job to re-enqueue if its holder dies);
    on the way out, whatever happened, the lease goes (``finish``, ``fail`` or ``requeue_upload`` said
    where the batch goes next)."""
    keys = RunKeys(run)
    pipe = r.pipeline()
    pipe.hset(keys.upload_jobs, bid, job.to_json())
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
def finish(r: redis.Redis, run: str, spec: ledger.BatchSpec, key: str, size: int, sha256: str, by: str,
           host: str | None = None) -> bool:
    """-> done. Call only after the store verified the object: the last write. True if newly recorded
    (a batch done already stays as it is; its failure and dead-letter records go either way). ``host``: the
    uploader's host, whose ``uploaded`` record (the last UPLOADED_SECONDS, its upload rate) gains the batch."""
    recorded = ledger.mark_done(r, run, spec, key, size, sha256, by)
    if recorded and host:
        ledger.note_uploaded(r, run, host, spec.batch_id, spec.tokens, size)
    return recorded


def reopen(r: redis.Redis, run: str, spec: ledger.BatchSpec, requeue: bool = True) -> bool:
    """done -> planned: its object is missing or bad. Out of the ledger (counters, index marker), no dead
    letter left, and (``requeue``) queued at the front. False, nothing written, if it was not done."""
    if not ledger.unmark_done(r, run, spec):
        return False
    pipe = r.pipeline()
    if requeue:  # first: rq opens the pipeline's MULTI
        enqueue(r, run, [spec.batch_id], at_front=True, pipe=pipe)
    ledger.take_dead_letters(r, run, [spec.batch_id], pipe=pipe)
    pipe.execute()
    return True


# ---- failed and dead -------------------------------------------------------------------------------
def fail(r: redis.Redis, run: str, bid: str, error: str, max_attempts: int, requeue: bool = True,
         at_front: bool = False, kept_upload: UploadJob | None = None, lost_worker: str | None = None) -> Failure:
    """leased | uploading -> failed | dead: count a failure (one script); below the run's ``max_attempts``
    the batch is extracted again (``requeue``; False: the caller queues its own next try), at it a dead
    letter. A done batch counts nothing (a late failure of a duplicate copy is no failure of the batch).
    ``kept_upload``: the upload job of a spool file kept (host, path, size, sha256, tier): a dead letter
    then remembers it, and ``retry`` uploads that file again instead of extracting the batch anew.
    ``lost_worker``: the reaper's, the worker that stopped beating while it held the batch."""
    attempts = ledger.record_failure(r, run, bid, error, max_attempts,
                                     kept="" if kept_upload is None else kept_upload.to_json(), lost_worker=lost_worker)
    if attempts == 0:
        return Failure(State.DONE, 0)
    if attempts >= max_attempts:
        log.error("batch %s of run %s failed %d times; moved to dead letters: %s", bid, run, attempts, error)
        return Failure(State.DEAD, attempts)
    if requeue:
        enqueue(r, run, [bid], at_front=at_front)
    log.warning("batch %s of run %s failed (attempt %d/%d)%s: %s", bid, run, attempts, max_attempts,
                ", re-enqueued" if requeue else "", error)
    return Failure(State.FAILED, attempts)


def upload_failed(r: redis.Redis, run: str, bid: str, job: UploadJob, why: UploadFailure, error: str, retry: int,
                  max_attempts: int, wait: Callable[[float], None]) -> Failure | None:
    """uploading | spooled -> failed | dead | spooled: the row of ``UPLOAD_FAILURES`` for ``why``, applied.
    ``retry``: the job's store failures so far; ``wait(seconds)``: the caller's backoff (the uploader's
    stop-aware pause, which logs), called before the next upload job is queued. Returns what was counted
    (None: nothing)."""
    policy = UPLOAD_FAILURES[why]
    failure = None
    if policy.counted:
        failure = fail(r, run, bid, policy.error + error, 1 if policy.dead_at_once else max_attempts,
                       requeue=policy.extract_again, kept_upload=job if policy.keep_file else None)
    if policy.upload_again and (failure is None or failure.state is State.FAILED):
        if policy.backoff:
            wait(upload_backoff(retry))
            retry += 1
        _upload_again(r, run, bid, job, retry)
    return failure


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
        name, host = holder or (None, None)
        why = f"worker lost: {name}{' on host ' + host if host else ''} stopped beating while it held the batch" \
            if name else "worker lost"
        if fail(r, run, bid, f"{why} (lease expired without heartbeat); reclaimed", max_attempts,
                at_front=True, lost_worker=name).attempts:
            reclaimed["extract"].append(bid)
    for raw in r.zrangebyscore(keys.upload_leases, "-inf", now):
        bid = text(raw)
        if not r.zrem(keys.upload_leases, bid):
            continue
        job = r.hget(keys.upload_jobs, bid)
        r.hdel(keys.upload_jobs, bid)
        if job is None or ledger.is_done(r, run, bid):
            continue
        _upload_again(r, run, bid, UploadJob.from_json(job), at_front=True)
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
        _upload_again(r, run, bid, UploadJob.from_json(kept))
    enqueue(r, run, extract)
    return taken
