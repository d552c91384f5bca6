"""Whether a run is complete: a role that finds it so says "idle" once instead of a progress line every interval."""

from __future__ import annotations

import redis

from hsx.life.keys import RunKeys
from hsx.redisconn import int_hash


def run_complete(r: redis.Redis, run: str) -> bool:
    """Planned (not still planning) and every planned batch done."""
    totals, done = int_hash(r, RunKeys(run).totals), int_hash(r, RunKeys(run).counters)
    return bool(totals.get("batches")) and not totals.get("planning") and totals["batches"] == done.get("batches", 0)
