"""Leases: which batches live processes are working on, so dead ones are reclaimed fast.

rq does not refresh a SimpleWorker job while it runs and sweeps a killed
worker's job only every 10 minutes, so hsx keeps its own: a ZSET per run of
batch id -> lease expiry (seconds on Redis' clock). A worker leases a batch when it takes
the job and holds it until the batch file is spooled and its upload enqueued;
an uploader leases a batch while it uploads. Heartbeats push the expiry
forward. ``hsx.life.batchlife.reap`` (run by every worker's heartbeat) takes back
batches whose lease expired; ZREM decides which reaper wins, so each is taken back once.
These are the lease primitives; a batch's transitions (hsx/life/batchlife.py) use them, and a worker's and
an uploader's heartbeat refresh what they hold by run (``refresh_extract_leases``, ``refresh_upload_leases``).

One clock: every expiry is written and compared on Redis' clock (``TIME``,
read inside the Lua scripts below), never a host's: a worker whose clock runs
ahead or behind neither holds a batch too long nor reclaims a live one.
"""

from __future__ import annotations

import redis

from hsx.life.keys import RunKeys

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


def refresh_extract_leases(r: redis.Redis, run: str, bids, lease_seconds: float, pipe=None) -> None:
    """Push forward the extract leases of ``bids`` a worker still holds (``refresh``)."""
    refresh(r, RunKeys(run).extract_leases, bids, lease_seconds, pipe=pipe)


def refresh_upload_leases(r: redis.Redis, run: str, bids, lease_seconds: float, pipe=None) -> None:
    """Push forward the upload leases of ``bids`` an uploader still holds (``refresh``)."""
    refresh(r, RunKeys(run).upload_leases, bids, lease_seconds, pipe=pipe)
