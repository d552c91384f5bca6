"""Worker heartbeats and per-host spool stats in Redis (leases: hsx/run/leases.py).

A heartbeat key expires on its own when its worker dies.
"""

from __future__ import annotations

import json
import math
import time

import redis

from hsx.defaults import HEARTBEAT_TTL_BEATS
from hsx.run import records
from hsx.run.keys import RunKeys


def ttl_seconds(heartbeat_seconds: float) -> int:
    """How long a heartbeat key lives: HEARTBEAT_TTL_BEATS beats (the one rule for every role)."""
    return max(1, math.ceil(heartbeat_seconds * HEARTBEAT_TTL_BEATS))


def publish_heartbeat(r: redis.Redis, run: str, worker_name: str, stats: dict, ttl_seconds: int, pipe=None) -> None:
    keys = RunKeys(run)
    now = time.time()
    own = pipe is None
    pipe = r.pipeline(transaction=False) if own else pipe
    pipe.set(keys.heartbeat(worker_name), json.dumps({**stats, "worker": worker_name, "ts": now}), ex=ttl_seconds)
    pipe.zadd(keys.workers, {worker_name: now})
    if own:
        pipe.execute()


def read_workers(r: redis.Redis, run: str, forget_after_seconds: float = 86400,
                 malformed: list[str] | None = None) -> list[dict]:
    """Every worker seen in the last day: its last stats, ``alive`` False once its heartbeat expired.

    A heartbeat that is not what a worker writes (hsx.run.records.HEARTBEAT) counts as none (the worker
    is listed with its name only) and is named in ``malformed``.
    """
    keys = RunKeys(run)
    malformed = [] if malformed is None else malformed
    now = time.time()
    out = []
    for raw_id, last in r.zrangebyscore(keys.workers, now - forget_after_seconds, "+inf", withscores=True):
        wid = records.name(raw_id)
        raw = r.get(keys.heartbeat(wid))
        stats = records.decode(raw, keys.heartbeat(wid), malformed, records.HEARTBEAT) if raw else None
        stats = {**(stats or {}), "worker": wid}
        stats.update(alive=raw is not None, last_seen=last, age_seconds=now - last)
        out.append(stats)
    return out


def publish_host(r: redis.Redis, run: str, host: str, stats: dict, pipe=None) -> None:
    (pipe or r).hset(RunKeys(run).hosts, host, json.dumps({**stats, "ts": time.time()}))


def read_hosts(r: redis.Redis, run: str, malformed: list[str] | None = None) -> dict[str, dict]:
    """Each host's last spool stats; a record that is not what hsx writes (hsx.run.records.HOST) is skipped
    and named in ``malformed``."""
    return records.json_hash(r, RunKeys(run).hosts, [] if malformed is None else malformed, records.HOST)
