"""The run's recent failures, kept after their batch is done.

A failure record (``failures``, ``dead``) goes when its batch is done: right for "what is failing now",
but a person looking at the page after a worker died must still see that a batch was reclaimed from it.
Every counted failure is also pushed here, newest first, capped at ERROR_LOG_LENGTH entries:
``hsx:<run>:error_log`` (LIST of JSON ``{batch, error, attempts, ts}``, and ``lost_worker``, the worker's name,
where the reaper took the batch back from a worker that stopped beating; no TTL).
"""

from __future__ import annotations

import json
import time

import redis

from hsx.life import records
from hsx.life.keys import RunKeys

ERROR_LOG_LENGTH = 100  # entries kept


def append(r: redis.Redis, run: str, bid: str, error: str, attempts: int, now: float | None = None,
           lost_worker: str | None = None) -> None:
    entry = {"batch": bid, "error": error[-2000:], "attempts": attempts, "ts": time.time() if now is None else now}
    entry = json.dumps({**entry, "lost_worker": lost_worker} if lost_worker else entry, separators=(",", ":"))
    pipe = r.pipeline(transaction=False)
    pipe.lpush(RunKeys(run).error_log, entry)
    pipe.ltrim(RunKeys(run).error_log, 0, ERROR_LOG_LENGTH - 1)
    pipe.execute()


def recent_failures(r: redis.Redis, run: str, malformed: list[str] | None = None) -> list[dict]:
    """The entries, newest first; one that is not what hsx writes is skipped and named in ``malformed``."""
    key, out = RunKeys(run).error_log, []
    malformed = [] if malformed is None else malformed
    for raw in r.lrange(key, 0, ERROR_LOG_LENGTH - 1):
        entry = records.decode(raw, key, malformed, records.ERROR_LOG, ("batch", "error", "ts"))
        if entry:
            out.append(entry)
    return out
