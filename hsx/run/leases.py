"""Leases: which batches live processes are working on, so dead ones are reclaimed fast.

rq does not refresh a SimpleWorker job while it runs and sweeps a killed
worker's job only every 10 minutes, so hsx keeps its own: a ZSET per run of
batch id -> lease expiry (seconds on Redis' clock). A worker leases a batch when it takes
the job and holds it until the batch file is spooled and its upload enqueued;
an uploader leases a batch while it uploads. Heartbeats push the expiry
forward. ``reap`` (run by every worker's heartbeat) re-enqueues batches whose
lease expired; ZREM decides which reaper wins, so each is re-enqueued once.

One clock: every expiry is written and compared on Redis' clock (``TIME``,
read inside the Lua scripts below), never a host's: a worker whose clock runs
ahead or behind neither holds a batch too long nor reclaims a live one.
"""

from __future__ import annotations

import json
import logging

import redis

from hsx.redisconn import text
from hsx.run import ledger, queues
from hsx.run.keys import RunKeys

log = logging.getLogger(__name__)


# KEYS: the lease ZSET ; ARGV: lease_seconds, xx ("1": only refresh existing members), batch ids...
# Sets each expiry to Redis TIME + lease_seconds. Returns Redis' now (seconds, as a string).
_SET_EXPIRY = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i = 3, #ARGV do
  if ARGV[2] ~= '1' or redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], expiry, ARGV[i])
  end
end
return tostring(expiry - tonumber(ARGV[1]))
"""


def redis_now(r: redis.Redis) -> float:
    """Seconds since the epoch on Redis' clock: the one clock of every lease decision."""
    seconds, micros = r.time()
    return seconds + micros / 1e6


def take(r: redis.Redis, zset: str, bid: str, lease_seconds: float, pipe=None) -> None:
    (pipe or r).eval(_SET_EXPIRY, 1, zset, lease_seconds, "0", bid)


def refresh(r: redis.Redis, zset: str, bids, lease_seconds: float, pipe=None) -> None:
    """Push expiry forward for leases still held (never resurrect a reaped one)."""
    bids = list(bids)
    if bids:
        (pipe or r).eval(_SET_EXPIRY, 1, zset, lease_seconds, "1", *bids)


def drop(r: redis.Redis, zset: str, bid: str, pipe=None) -> None:
    (pipe or r).zrem(zset, bid)


def take_upload(r: redis.Redis, run: str, bid: str, job: dict, lease_seconds: float) -> None:
    keys = RunKeys(run)
    pipe = r.pipeline()
    pipe.hset(keys.upload_jobs, bid, json.dumps(job))
    take(r, keys.upload_leases, bid, lease_seconds, pipe=pipe)
    pipe.execute()


def drop_upload(r: redis.Redis, run: str, bid: str, pipe=None) -> None:
    keys = RunKeys(run)
    p = pipe or r.pipeline()
    p.zrem(keys.upload_leases, bid)
    p.hdel(keys.upload_jobs, bid)
    if pipe is None:
        p.execute()


def next_attempt(r: redis.Redis, run: str) -> int:
    """A fresh job-id suffix: re-enqueued jobs never reuse an id a dead worker may still hold."""
    return 1000 + int(r.incr(RunKeys(run).job_seq))


def reap(r: redis.Redis, run: str, max_attempts: int, now: float | None = None) -> dict[str, list[str]]:
    """Re-enqueue batches whose lease expired (``now``: Redis TIME unless given). Returns {"extract": [...], "upload": [...]} reclaimed."""
    keys = RunKeys(run)
    now = redis_now(r) if now is None else now
    reclaimed: dict[str, list[str]] = {"extract": [], "upload": []}
    for raw in r.zrangebyscore(keys.extract_leases, "-inf", now):
        bid = text(raw)
        if not r.zrem(keys.extract_leases, bid):
            continue  # another reaper took it, or it was refreshed and dropped meanwhile
        if ledger.is_done(r, run, bid):
            continue
        attempts = ledger.record_failure(r, run, bid, "worker lost: lease expired without heartbeat", max_attempts)
        if attempts < max_attempts:
            queues.enqueue_extract(r, run, bid, attempt=next_attempt(r, run), at_front=True)
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
        queues.enqueue_upload(r, kw["host"], run, bid, kw["path"], kw["size"], kw["sha256"], attempt=next_attempt(r, run),
                              at_front=True, tier=kw.get("tier", "disk"))
        reclaimed["upload"].append(bid)
    for kind, bids in reclaimed.items():
        if bids:
            log.warning("reclaimed %d %s batches of run %s from dead processes: %s", len(bids), kind, run, bids[:10])
    return reclaimed


