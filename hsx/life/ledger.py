"""The completion ledger and run bookkeeping in Redis.

The ledger (``done``) is the truth: a batch is done when, and only when, its
object was verified in the store and ``mark_done`` recorded it. Everything
else here (counters, logs, heartbeats) is derived or advisory. The writes that
change a batch's state (``mark_done``, ``unmark_done``, ``record_failure``,
``mark_spooled``, ``clear_failure``, ``take_dead_letters``) are primitives of
``hsx.life.batchlife``, the one caller of them in hsx. Every function
takes the Redis client explicitly; multi-key updates are one script or one
pipeline. The order batches were recorded done in (``done_seq``, what followers read) is
``hsx.life.donesequence``'s.
"""

from __future__ import annotations

import time

import redis

from hsx.errors import HsxError
from hsx.life import doneledger, errorlog, oldledger, records
from hsx.life.batchspec import BatchSpec  # the plan's record (ledger.BatchSpec, as every reader names it)
from hsx.life.keys import LOG_KEEP, LOG_SECONDS, RUNS, UPLOADED_SECONDS, RunKeys
from hsx.redisconn import int_hash, text
from hsx.runspec import Manifest

# KEYS: done prefix, done_chunks, counters, shard_done, done_log, failures, dead, done_seq, old done SET, rate_minutes
# ARGV: batch_id, record (hsx.life.doneledger.encode), samples, tokens, bytes, shard, now, unix minute, LOG_SECONDS,
# LOG_KEEP, mixture source ("" for a run of one dataset: its batches, samples and tokens counted under src:<source>:)
# Returns 1 if this call recorded the batch, 0 if it was already done, -1 (nothing written) for a run whose ledger
# an older hsx wrote (hsx/life/oldledger.py). Either way (1 or 0) the batch is no longer a failure or a
# dead letter: a batch done is done (a dead letter left from before a Redis loss, or by an upload that ran while the
# plan was being saved again, must not outlive it). A batch recorded for the first time is appended to done_seq
# (the order a run follower reads batches in); one recorded again after a repair (its record emptied) keeps its place.
_MARK_DONE = doneledger.LUA_DONE + """
if redis.call('EXISTS', KEYS[9]) == 1 then return -1 end
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
local key, field = done_slot(KEYS[1], ARGV[1])
local was = redis.call('HGET', key, field)
if was and #was > 0 then return 0 end
if not was then
  redis.call('RPUSH', KEYS[8], ARGV[1])
  redis.call('SADD', KEYS[2], string.sub(key, #KEYS[1] + 1))
end
redis.call('HSET', key, field, ARGV[2])
redis.call('HINCRBY', KEYS[3], 'batches', 1)
redis.call('HINCRBY', KEYS[3], 'samples', ARGV[3])
redis.call('HINCRBY', KEYS[3], 'tokens', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'bytes', ARGV[5])
if ARGV[11] ~= '' then
  redis.call('HINCRBY', KEYS[3], 'src:' .. ARGV[11] .. ':b', 1)
  redis.call('HINCRBY', KEYS[3], 'src:' .. ARGV[11] .. ':s', ARGV[3])
  redis.call('HINCRBY', KEYS[3], 'src:' .. ARGV[11] .. ':t', ARGV[4])
end
redis.call('HINCRBY', KEYS[4], ARGV[6], 1)
redis.call('ZADD', KEYS[5], ARGV[7], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', tonumber(ARGV[7]) - tonumber(ARGV[9]))
redis.call('ZREMRANGEBYRANK', KEYS[5], 0, -tonumber(ARGV[10]) - 1)
redis.call('HSETNX', KEYS[10], 'done:first', math.floor(tonumber(ARGV[7])))
redis.call('HSET', KEYS[10], 'done:last', ARGV[7])
redis.call('HINCRBY', KEYS[10], 'done:' .. ARGV[8] .. ':b', 1)
redis.call('HINCRBY', KEYS[10], 'done:' .. ARGV[8] .. ':s', ARGV[3])
redis.call('HINCRBY', KEYS[10], 'done:' .. ARGV[8] .. ':t', ARGV[4])
return 1
"""

# KEYS: spooled_log, rate_minutes, plan ; ARGV: batch_id, now, unix minute, LOG_SECONDS, LOG_KEEP
# A batch reaching a spool for the first time (in the last LOG_SECONDS and LOG_KEEP batches: the log keeps no more):
# its time in spooled_log, its minute's counts (samples and tokens from its plan entry; 0 where that is not one) and
# the run's count, first and last time in rate_minutes. Returns 1 if first.
_MARK_SPOOLED = """
if redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1]) == 0 then return 0 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[4]))
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[5]) - 1)
redis.call('HSETNX', KEYS[2], 'spooled:first', math.floor(tonumber(ARGV[2])))
redis.call('HSET', KEYS[2], 'spooled:last', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'spooled:count', 1)
local samples, tokens = 0, 0
local raw = redis.call('HGET', KEYS[3], ARGV[1])
if raw then
  local ok, spec = pcall(cjson.decode, raw)
  if ok and type(spec) == 'table' then
    samples = tonumber(spec['samples']) or 0
    tokens = tonumber(spec['tokens']) or 0
  end
end
redis.call('HINCRBY', KEYS[2], 'spooled:' .. ARGV[3] .. ':b', 1)
redis.call('HINCRBY', KEYS[2], 'spooled:' .. ARGV[3] .. ':s', samples)
redis.call('HINCRBY', KEYS[2], 'spooled:' .. ARGV[3] .. ':t', tokens)
return 1
"""

# KEYS: failures, dead, done prefix, kept_uploads ; ARGV: batch_id, error, now, max_attempts, kept upload job JSON
# (or ""). Returns the attempt count; moves the record to dead letters at max_attempts (with the kept upload, if
# any). A batch already done records nothing and returns 0 (a late failure of a duplicate copy is no failure of the
# batch).
_RECORD_FAILURE = doneledger.LUA_DONE + """
if is_done(KEYS[3], ARGV[1]) then return 0 end
local raw = redis.call('HGET', KEYS[1], ARGV[1])
local attempts = 1
if raw then
  local ok, old = pcall(cjson.decode, raw)
  if ok and type(old) == 'table' and tonumber(old['attempts']) then attempts = tonumber(old['attempts']) + 1 end
end
local rec = cjson.encode({attempts=attempts, last_error=ARGV[2], ts=tonumber(ARGV[3])})
if attempts >= tonumber(ARGV[4]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HSET', KEYS[2], ARGV[1], rec)
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[4], ARGV[1], ARGV[5]) end
else
  redis.call('HSET', KEYS[1], ARGV[1], rec)
end
return attempts
"""


def list_runs(r: redis.Redis) -> list[str]:
    return sorted(text(x) for x in r.smembers(RUNS))


def get_manifest(r: redis.Redis, run: str) -> Manifest | None:
    """The run's manifest, None if Redis has none; ManifestError if it is not one this hsx reads."""
    key = RunKeys(run).manifest
    raw = r.get(key)
    return Manifest.from_json(raw, f"Redis {key}") if raw else None


class RunVanished(HsxError, KeyError):
    """The run has no manifest in this Redis: never planned here, or gone (Redis restarted empty, flushed).
    The one exception for it, raised by every role and tool; the message says which and what to do."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def require_manifest(r: redis.Redis, run: str) -> Manifest:
    """The run's manifest, or RunVanished naming the run and what to do."""
    manifest = get_manifest(r, run)
    if manifest is None:
        known = list_runs(r)
        raise RunVanished(f"run {run!r} is not planned in this Redis (runs here: {', '.join(known) or 'none'}); "
                            "run `hsx produce` first, or check --run / HSX_RUN and HSX_REDIS_URL")
    return manifest


def save_plan(r: redis.Redis, run: str, manifest: Manifest, specs: list[BatchSpec], totals: dict[str, int]) -> None:
    """Record manifest, plan and totals. Idempotent: the same plan overwrites itself."""
    keys = RunKeys(run)
    pipe = r.pipeline(transaction=False)
    for start in range(0, len(specs), 1000):
        pipe.hset(keys.plan, mapping={s.batch_id: s.to_json() for s in specs[start:start + 1000]})
    pipe.hset(keys.totals, mapping={k: int(v) for k, v in totals.items()})
    pipe.set(keys.manifest, manifest.to_json())
    pipe.sadd(RUNS, run)
    pipe.execute()


def get_spec(r: redis.Redis, run: str, bid: str) -> BatchSpec | None:
    raw = r.hget(RunKeys(run).plan, bid)
    return BatchSpec.from_json(raw, bid) if raw else None


def get_specs(r: redis.Redis, run: str, bids: list[str]) -> list[BatchSpec]:
    """The specs of ``bids`` in their order (one HMGET); a batch not in the plan is left out."""
    return [BatchSpec.from_json(raw, bid) for bid, raw in zip(bids, r.hmget(RunKeys(run).plan, bids), strict=True) if raw]


def all_specs(r: redis.Redis, run: str) -> dict[str, BatchSpec]:
    return {text(k): BatchSpec.from_json(v, text(k)) for k, v in r.hscan_iter(RunKeys(run).plan, count=1000)}


def done_ids(r: redis.Redis, run: str) -> set[str]:
    """Every done batch: O(run) (hsx.life.doneledger); OldLedger for a run an older hsx recorded."""
    oldledger.refuse(r, run)
    return doneledger.done_ids(r, run)


def is_done(r: redis.Redis, run: str, bid: str) -> bool:
    return bool(done_among(r, run, [bid]))


def done_among(r: redis.Redis, run: str, bids: list[str]) -> set[str]:
    """Those of ``bids`` the ledger holds done (one HMGET a hundred batches, pipelined; none for no ``bids``)."""
    return doneledger.done_among(r, run, bids) if bids else set()


def done_count(r: redis.Redis, run: str) -> int:
    """Batches done now (one HGET of the counter the ledger's scripts keep)."""
    return doneledger.done_count(r, run)


def mark_done(r: redis.Redis, run: str, spec: BatchSpec, key: str, size: int, sha256: str, by: str) -> bool:
    """Record a verified batch. Call only after the store verified the object. True if newly recorded.

    Its record is its object's size and SHA-256 (hsx.life.doneledger), what every reader checks an object against
    (the object's key is the run's layout's, ``by`` is in the uploader's log, the time in ``done_log``).
    OldLedger (nothing written) for a run whose ledger an older hsx wrote (sets and a hash a batch)."""
    keys = RunKeys(run)
    now = time.time()
    recorded = int(r.eval(_MARK_DONE, 10, keys.done_prefix, keys.done_chunks, keys.counters, keys.shard_done,
                          keys.done_log, keys.failures, keys.dead, keys.done_seq, keys.done, keys.rate_minutes,
                          spec.batch_id, doneledger.encode(size, sha256), spec.samples, spec.tokens, size, spec.shard,
                          now, int(now // 60), LOG_SECONDS, LOG_KEEP, spec.source))
    if recorded < 0:
        raise oldledger.OldLedger(oldledger.why_old(run))
    return recorded == 1


def note_uploaded(r: redis.Redis, run: str, host: str, bid: str, tokens: int = 0, nbytes: int = 0) -> None:
    """``host``'s uploaders recorded ``bid`` (``tokens``, ``nbytes``) done now: the minute's counts of the host in
    ``rate_minutes`` (``up:<host>:<minute>:b|t|B``, and ``up:<host>:since``: its upload rate, read in O(minutes)), and
    its ``uploaded``
    record gains it and forgets what is older than UPLOADED_SECONDS or the LOG_KEEP newest (one pipeline; neither
    grows with the run)."""
    keys, now = RunKeys(run), time.time()
    pipe = r.pipeline(transaction=False)
    pipe.hsetnx(keys.rate_minutes, f"up:{host}:since", int(now))
    for what, n in (("b", 1), ("t", tokens), ("B", nbytes)):
        pipe.hincrby(keys.rate_minutes, f"up:{host}:{int(now // 60)}:{what}", n)
    pipe.zadd(keys.uploaded(host), {bid: now})
    pipe.zremrangebyscore(keys.uploaded(host), "-inf", now - UPLOADED_SECONDS)
    pipe.zremrangebyrank(keys.uploaded(host), 0, -LOG_KEEP - 1)
    pipe.execute()


def uploaded_since(r: redis.Redis, run: str, host: str, since: float) -> list[str]:
    """Batches ``host``'s uploaders recorded done since ``since`` (unix s; at most UPLOADED_SECONDS back)."""
    return [text(b) for b in r.zrangebyscore(RunKeys(run).uploaded(host), since, "+inf")]


WRITTEN_BYTES = "written_bytes"  # field of the counters HASH: bytes of batch files written to spools (rewrites too)


def mark_spooled(r: redis.Redis, run: str, bid: str, pipe=None, nbytes: int = 0) -> None:
    """Note when a batch reached a spool (first time only): feeds the extraction-rate chart and the minute's
    counts of the rate; count its bytes."""
    keys, now = RunKeys(run), time.time()
    (pipe or r).eval(_MARK_SPOOLED, 3, keys.spooled_log, keys.rate_minutes, keys.plan, bid, now, int(now // 60),
                     LOG_SECONDS, LOG_KEEP)
    if nbytes:
        (pipe or r).hincrby(RunKeys(run).counters, WRITTEN_BYTES, nbytes)


def record_failure(r: redis.Redis, run: str, bid: str, error: str, max_attempts: int, kept: str = "",
                   lost_worker: str | None = None) -> int:
    """Count a failure of ``bid``: its attempt count (a dead letter at ``max_attempts``), or 0 if it is done.
    ``kept``: the JSON of a kept spool file's upload job, written to ``kept_uploads`` if it becomes a dead letter
    (in the same script). ``lost_worker``: the worker the reaper took the batch back from (in the error log)."""
    keys = RunKeys(run)
    attempts = int(r.eval(_RECORD_FAILURE, 4, keys.failures, keys.dead, keys.done_prefix, keys.kept_uploads, bid,
                          error[-2000:], time.time(), max_attempts, kept))
    if attempts:
        errorlog.append(r, run, bid, error, attempts, lost_worker=lost_worker)  # kept after the batch is done
    return attempts


def drop_failures_of_done(r: redis.Redis, run: str) -> list[str]:
    """Remove the failure and dead-letter records of batches that are done (left by an older hsx, or from
    before a Redis loss whose ledger was rebuilt from the store); return their ids."""
    keys = RunKeys(run)
    bids = sorted({text(b) for key in (keys.failures, keys.dead) for b in r.hkeys(key)})
    if not bids:
        return []
    done = done_among(r, run, bids)
    settled = [b for b in bids if b in done]
    _drop_failure_records(r, keys, settled)
    return settled


def _drop_failure_records(r: redis.Redis, keys: RunKeys, bids: list[str], pipe=None) -> None:
    """Remove the failure and dead-letter records of ``bids`` (one round trip; in ``pipe`` if given)."""
    if bids:
        p = pipe if pipe is not None else r.pipeline()
        p.hdel(keys.failures, *bids)
        p.hdel(keys.dead, *bids)
        if pipe is None:
            p.execute()


def clear_failure(r: redis.Redis, run: str, bid: str, pipe=None) -> None:
    (pipe or r).hdel(RunKeys(run).failures, bid)


def dead_letters(r: redis.Redis, run: str, malformed: list[str] | None = None) -> dict[str, dict]:
    """Dead letters by batch id; a malformed record is a placeholder named in ``malformed`` (hsx.life.records)."""
    return records.failure_hash(r, RunKeys(run).dead, [] if malformed is None else malformed)


def failures(r: redis.Redis, run: str, malformed: list[str] | None = None) -> dict[str, dict]:
    """Batches being retried after a failure, by batch id (malformed records as in dead_letters)."""
    return records.failure_hash(r, RunKeys(run).failures, [] if malformed is None else malformed)


def take_dead_letters(r: redis.Redis, run: str, bids: list[str] | None = None, pipe=None) -> list[str]:
    """Remove dead letters (all, or ``bids``; in ``pipe`` if given) and return the batch ids taken."""
    keys = RunKeys(run)
    taken = list(dead_letters(r, run)) if bids is None else bids
    _drop_failure_records(r, keys, taken, pipe)
    return taken


def run_totals(r: redis.Redis, run: str) -> dict[str, int]:
    return int_hash(r, RunKeys(run).totals)


# KEYS: done prefix, counters, shard_done, done_log, index marker ; ARGV: batch_id, samples, tokens, shard, mixture
# source (as _MARK_DONE)
# Undo a mark_done whose object turned out missing or corrupt: its record emptied (it keeps its place in done_seq).
# Returns 1 if it was done. The index marker goes too: the index is written again (with the new object's digest)
# once the run completes.
_UNMARK_DONE = doneledger.LUA_DONE + """
local key, field = done_slot(KEYS[1], ARGV[1])
local raw = redis.call('HGET', key, field)
if not raw or #raw == 0 then return 0 end
redis.call('HSET', key, field, '')
redis.call('DEL', KEYS[5])
local size = tonumber(string.sub(raw, 33)) or 0
redis.call('HINCRBY', KEYS[2], 'batches', -1)
redis.call('HINCRBY', KEYS[2], 'samples', -tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[2], 'tokens', -tonumber(ARGV[3]))
redis.call('HINCRBY', KEYS[2], 'bytes', -size)
if ARGV[5] ~= '' then
  redis.call('HINCRBY', KEYS[2], 'src:' .. ARGV[5] .. ':b', -1)
  redis.call('HINCRBY', KEYS[2], 'src:' .. ARGV[5] .. ':s', -tonumber(ARGV[2]))
  redis.call('HINCRBY', KEYS[2], 'src:' .. ARGV[5] .. ':t', -tonumber(ARGV[3]))
end
redis.call('HINCRBY', KEYS[3], ARGV[4], -1)
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""


def unmark_done(r: redis.Redis, run: str, spec: BatchSpec) -> bool:
    """Take a batch out of the ledger (its object is missing or corrupt), counters included."""
    keys = RunKeys(run)
    return bool(r.eval(_UNMARK_DONE, 5, keys.done_prefix, keys.counters, keys.shard_done, keys.done_log,
                       keys.index_written, spec.batch_id, spec.samples, spec.tokens, spec.shard,
                       spec.source))


def done_counters(r: redis.Redis, run: str) -> dict[str, int]:
    """The run's done counters (one small hash): batches, samples, tokens, bytes, and a mixture's per source
    (``src:<source>:b|s|t``), as the scripts that record a batch done or take it out move them."""
    return int_hash(r, RunKeys(run).counters)


def done_info(r: redis.Redis, run: str) -> dict[str, dict]:
    """Batch id -> {size, sha256} of every done batch: O(run); OldLedger for a run an older hsx recorded."""
    oldledger.refuse(r, run)
    return doneledger.done_info(r, run)


def done_records(r: redis.Redis, run: str, bids: list[str]) -> dict[str, dict | None]:
    """The ledger's records of ``bids`` ({size, sha256}; None: not done, or a record this hsx does not write)."""
    return {bid: doneledger.decode(raw) for bid, raw in doneledger.records_of(r, run, bids).items()}


def done_record(r: redis.Redis, run: str, bid: str) -> dict | None:
    """The ledger's record of ``bid`` ({size, sha256}, as ``mark_done`` wrote it); None while it is not done (never
    was, or a repair took it out)."""
    return doneledger.done_record(r, run, bid)
