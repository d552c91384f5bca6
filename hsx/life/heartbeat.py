"""Worker heartbeats and per-host spool stats in Redis (leases: hsx/life/leases.py).

A heartbeat key expires on its own when its worker dies. A worker that stops cleanly says so (``publish_stopped``:
its final totals, with ``stopped``, its time, and no heartbeat key). A worker's state, one word in every view
(``hsx status``, its --json, the dashboard, /api/status, /metrics):

- ``alive``: its heartbeat key lives;
- ``stopped``: it stopped cleanly (its record holds ``stopped``): its totals are final;
- ``lost``: its heartbeat ran out without a goodbye (killed, its host gone, cut off from Redis): its totals are
  those of its last beat, and a batch it held comes back through its lease.

What the worker was stays until it is swept
(``sweep_heartbeats``, a day after its last beat): its last heartbeat (``worker_last``: host, device, totals) and the
batch it leased last (``worker_batch``, written when the lease is taken, so ``current_batch`` is never a
heartbeat old), so a dead worker keeps its name, host, totals and last batch on every view.
"""

from __future__ import annotations

import json
import math
import time

import redis

from hsx.defaults import HEARTBEAT_TTL_BEATS
from hsx.life import records
from hsx.life.keys import RunKeys


def ttl_seconds(heartbeat_seconds: float) -> int:
    """How long a heartbeat key lives: HEARTBEAT_TTL_BEATS beats (the one rule for every role)."""
    return max(1, math.ceil(heartbeat_seconds * HEARTBEAT_TTL_BEATS))


def publish_heartbeat(r: redis.Redis, run: str, worker_name: str, stats: dict, ttl_seconds: int, pipe=None) -> None:
    keys = RunKeys(run)
    now = time.time()
    own = pipe is None
    pipe = r.pipeline(transaction=False) if own else pipe
    payload = json.dumps({**stats, "worker": worker_name, "ts": now})
    pipe.set(keys.heartbeat(worker_name), payload, ex=ttl_seconds)
    pipe.hset(keys.worker_last, worker_name, payload)
    pipe.zadd(keys.workers, {worker_name: now})
    if own:
        pipe.execute()


def publish_stopped(r: redis.Redis, run: str, worker_name: str, stats: dict) -> None:
    """``worker_name`` stopped cleanly: its last record holds its final ``stats`` and ``stopped`` (now), and its
    heartbeat key goes (it is gone, not dead: no TTL's wait). One pipeline."""
    keys = RunKeys(run)
    now = time.time()
    pipe = r.pipeline(transaction=True)
    pipe.delete(keys.heartbeat(worker_name))
    pipe.hset(keys.worker_last, worker_name, json.dumps({**stats, "worker": worker_name, "ts": now, "stopped": now}))
    pipe.zadd(keys.workers, {worker_name: now})
    pipe.execute()


def worker_state(alive: bool, record: dict) -> str:
    """alive | stopped | lost (the module's docstring says what each means)."""
    return "alive" if alive else "stopped" if record.get("stopped") is not None else "lost"


def worker_alive(r: redis.Redis, run: str, worker_name: str) -> bool:
    """The worker's heartbeat has not expired (EXISTS of its heartbeat key)."""
    return bool(r.exists(RunKeys(run).heartbeat(worker_name)))


FORGET_AFTER_SECONDS = 86400  # s after its last beat a worker is no longer listed, and is swept


def publish_current(r: redis.Redis, run: str, worker_name: str, bid: str, pipe=None) -> None:
    """The batch ``worker_name`` just leased: what `hsx status` names as its current batch while it holds it."""
    (pipe or r).hset(RunKeys(run).worker_batch, worker_name, bid)


def read_workers(r: redis.Redis, run: str, forget_after_seconds: float = FORGET_AFTER_SECONDS,
                 malformed: list[str] | None = None) -> list[dict]:
    """Every worker seen in the last day: its last stats, ``alive`` False once its heartbeat expired (then
    its last heartbeat stands in: host, device, totals), ``state`` alive | stopped | lost. ``current_batch``: the batch it leased last while
    it still holds that lease and lives, else None; ``last_batch``: that batch, held or not.

    A heartbeat that is not what a worker writes (hsx.life.records.HEARTBEAT) counts as none (the worker
    is listed with its name only) and is named in ``malformed``.
    """
    keys = RunKeys(run)
    malformed = [] if malformed is None else malformed
    now = time.time()
    out = []
    for raw_id, last in r.zrangebyscore(keys.workers, now - forget_after_seconds, "+inf", withscores=True):
        wid = records.name(raw_id)
        raw = r.get(keys.heartbeat(wid))
        where = keys.heartbeat(wid) if raw else f"{keys.worker_last} {wid}"
        record = raw if raw else r.hget(keys.worker_last, wid)
        stats = records.decode(record, where, malformed, records.HEARTBEAT) if record else None
        stats = {**(stats or {}), "worker": wid}
        leased = r.hget(keys.worker_batch, wid)
        if leased is not None:
            bid = records.name(leased)
            held = raw is not None and r.zscore(keys.extract_leases, bid) is not None
            stats.update(current_batch=bid if held else None, last_batch=bid)
        else:  # an uploader, or a worker of an older hsx: its heartbeat's word
            stats.update(current_batch=stats.get("current_batch") if raw else None,
                         last_batch=stats.get("current_batch"))
        stats.update(alive=raw is not None, state=worker_state(raw is not None, stats), last_seen=last,
                     age_seconds=now - last)
        out.append(stats)
    return out


def last_holder(r: redis.Redis, run: str, bid: str) -> tuple[str, str | None] | None:
    """(name, host or None) of the worker whose last lease was ``bid``, for the reaper's failure record."""
    keys = RunKeys(run)
    for wid, leased in r.hgetall(keys.worker_batch).items():
        if records.name(leased) == bid:
            name = records.name(wid)
            last = records.decode(r.hget(keys.worker_last, name) or b"{}", keys.worker_last, [], records.HEARTBEAT)
            return name, (last or {}).get("host")
    return None


def sweep_heartbeats(r: redis.Redis, run: str, forget_after_seconds: float = FORGET_AFTER_SECONDS) -> list[str]:
    """Forget workers not seen for ``forget_after_seconds``: their place in ``workers``, last heartbeat and last
    batch. Returns their names."""
    keys = RunKeys(run)
    gone = [records.name(w) for w in r.zrangebyscore(keys.workers, "-inf", time.time() - forget_after_seconds)]
    if gone:
        pipe = r.pipeline()
        pipe.zrem(keys.workers, *gone)
        pipe.hdel(keys.worker_last, *gone)
        pipe.hdel(keys.worker_batch, *gone)
        pipe.execute()
    return gone


def publish_host(r: redis.Redis, run: str, host: str, stats: dict, pipe=None) -> None:
    (pipe or r).hset(RunKeys(run).hosts, host, json.dumps({**stats, "ts": time.time()}))


def read_hosts(r: redis.Redis, run: str, malformed: list[str] | None = None) -> dict[str, dict]:
    """Each host's last spool stats; a record that is not what hsx writes (hsx.life.records.HOST) is skipped
    and named in ``malformed``."""
    return records.json_hash(r, RunKeys(run).hosts, [] if malformed is None else malformed, records.HOST)
