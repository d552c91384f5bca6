"""One line when a role goes idle because its run is complete, instead of a progress line every interval."""

from __future__ import annotations

import logging

import redis

from hsx.redisconn import int_hash
from hsx.run.keys import RunKeys

log = logging.getLogger(__name__)


def run_complete(r: redis.Redis, run: str) -> bool:
    """Planned (not still planning) and every planned batch done."""
    totals, done = int_hash(r, RunKeys(run).totals), int_hash(r, RunKeys(run).counters)
    return bool(totals.get("batches")) and not totals.get("planning") and totals["batches"] == done.get("batches", 0)


class IdleNote:
    """Says "run X complete, idle" once; ``quiet`` tells the caller to skip its progress line meanwhile."""

    def __init__(self, who: str):
        self.who = who
        self.said: set[str] = set()

    def quiet(self, r: redis.Redis, run: str, queue_name: str) -> bool:
        try:
            complete = run_complete(r, run)
        except redis.RedisError:
            return False
        if not complete:
            self.said.discard(run)
            return False
        if run not in self.said:
            self.said.add(run)
            log.info("run %s complete, idle: %s waits for jobs on %s", run, self.who, queue_name)
        return True
