"""Worker heartbeats, batch leases and per-host spool stats in Redis.

A heartbeat key expires on its own when its worker dies; a lease says "this
batch is being worked on by a live worker" and expires ``lease_seconds``
after the last refresh.
"""

from __future__ import annotations

import json
import time

import redis

from hsx.keys import RunKeys


def publish_heartbeat(r: redis.Redis, run: str, worker_id: str, stats: dict, ttl_seconds: int,
                      leases: list[str] = (), lease_seconds: int = 60) -> None:
    keys = RunKeys(run)
    now = time.time()
    pipe = r.pipeline(transaction=False)
    pipe.set(keys.heartbeat(worker_id), json.dumps({**stats, "worker": worker_id, "ts": now}), ex=ttl_seconds)
    pipe.zadd(keys.workers, {worker_id: now})
    for bid in leases:
        pipe.set(keys.lease(bid), worker_id, ex=lease_seconds)
    pipe.execute()


def read_workers(r: redis.Redis, run: str, forget_after_seconds: float = 86400) -> list[dict]:
    """Every worker seen in the last day: its last stats, ``alive`` False once its heartbeat expired."""
    keys = RunKeys(run)
    now = time.time()
    out = []
    for raw_id, last in r.zrangebyscore(keys.workers, now - forget_after_seconds, "+inf", withscores=True):
        wid = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
        raw = r.get(keys.heartbeat(wid))
        stats = json.loads(raw) if raw else {"worker": wid}
        stats.update(alive=raw is not None, last_seen=last, age_seconds=now - last)
        out.append(stats)
    return out


def acquire_lease(r: redis.Redis, run: str, bid: str, worker_id: str, lease_seconds: int) -> None:
    r.set(RunKeys(run).lease(bid), worker_id, ex=lease_seconds)


def release_lease(r: redis.Redis, run: str, bid: str, pipe=None) -> None:
    (pipe or r).delete(RunKeys(run).lease(bid))


def lease_holder(r: redis.Redis, run: str, bid: str) -> str | None:
    raw = r.get(RunKeys(run).lease(bid))
    return raw.decode() if isinstance(raw, bytes) else raw


def publish_host(r: redis.Redis, run: str, host: str, stats: dict, pipe=None) -> None:
    (pipe or r).hset(RunKeys(run).hosts, host, json.dumps({**stats, "ts": time.time()}))


def read_hosts(r: redis.Redis, run: str) -> dict[str, dict]:
    return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in r.hgetall(RunKeys(run).hosts).items()}
