"""Worker heartbeats and per-host spool stats in Redis (leases: hsx/leases.py).

A heartbeat key expires on its own when its worker dies.
"""

from __future__ import annotations

import json
import math
import time

import redis

from hsx.defaults import HEARTBEAT_TTL_BEATS
from hsx.keys import RunKeys
from hsx.redisconn import json_hash, text


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


def read_workers(r: redis.Redis, run: str, forget_after_seconds: float = 86400) -> list[dict]:
    """Every worker seen in the last day: its last stats, ``alive`` False once its heartbeat expired."""
    keys = RunKeys(run)
    now = time.time()
    out = []
    for raw_id, last in r.zrangebyscore(keys.workers, now - forget_after_seconds, "+inf", withscores=True):
        wid = text(raw_id)
        raw = r.get(keys.heartbeat(wid))
        stats = json.loads(raw) if raw else {"worker": wid}
        stats.update(alive=raw is not None, last_seen=last, age_seconds=now - last)
        out.append(stats)
    return out


def publish_host(r: redis.Redis, run: str, host: str, stats: dict, pipe=None) -> None:
    (pipe or r).hset(RunKeys(run).hosts, host, json.dumps({**stats, "ts": time.time()}))


def read_hosts(r: redis.Redis, run: str) -> dict[str, dict]:
    return json_hash(r, RunKeys(run).hosts)
