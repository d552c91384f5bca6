"""The producer's progress through the dataset, in Redis: one record a planned window.

A window's record (``hsx:<run>:windows``, window number -> JSON) is written
last, after its inputs are in the store, its batches in the plan and its jobs
on the queue. A producer that was killed resumes after the last contiguous
recorded window; a window it had half done is planned again, to the same
batch ids (deterministic), and its jobs already queued are not queued again.
"""

from __future__ import annotations

import json

import redis

from hsx import life
from hsx.life import RunKeys
from hsx.redisconn import text


def load(r: redis.Redis, run: str) -> list[dict]:
    """Records of windows 0..k-1 (the contiguous prefix that was completed), in order."""
    found = {int(text(k)): json.loads(v) for k, v in r.hgetall(RunKeys(run).windows).items()}
    records = []
    while len(records) in found:
        records.append(found[len(records)])
    return records


def record(r: redis.Redis, run: str, number: int, rec: dict) -> None:
    r.hset(RunKeys(run).windows, str(number), json.dumps(rec, separators=(",", ":"), sort_keys=True))


def withdraw(r: redis.Redis, run: str) -> int:
    """Take the plan back: queued jobs off the queue and out of the plan, the window records forgotten
    (``hsx.life.withdraw``, a transition of each batch). Returns the number of jobs withdrawn."""
    return life.withdraw(r, run)


def forget_from(r: redis.Redis, run: str, number: int) -> None:
    """Forget the records of windows ``number`` and later: the next producer plans them again."""
    found = [text(k) for k in r.hkeys(RunKeys(run).windows)]
    stale = [k for k in found if int(k) >= number]
    if stale:
        r.hdel(RunKeys(run).windows, *stale)
