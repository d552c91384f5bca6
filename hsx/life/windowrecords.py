"""The producer's window records: ``hsx:<run>:windows``, window number -> the JSON record of a planned window.

A record is written last for its window, after its inputs are in the store, its batches in the plan and its
jobs on the queue; a resumed producer goes on after the last contiguous one. What a record holds is the
producer's (``producer.windows.WindowRecord``); here it is text. ``withdraw`` (hsx/life/batchlife.py) forgets
them all with the plan it takes back.
"""

from __future__ import annotations

import redis

from hsx.life.keys import RunKeys
from hsx.redisconn import text


def window_records(r: redis.Redis, run: str) -> dict[int, bytes]:
    """Every recorded window, number -> its JSON record as stored (one HGETALL), contiguous or not."""
    return {int(text(k)): v for k, v in r.hgetall(RunKeys(run).windows).items()}


def save_window(r: redis.Redis, run: str, number: int, record_json: str) -> None:
    """Record window ``number`` planned and enqueued (overwrites a record of the same window)."""
    r.hset(RunKeys(run).windows, str(number), record_json)


def forget_windows_from(r: redis.Redis, run: str, number: int) -> None:
    """Forget the records of windows ``number`` and later: the next producer plans them again."""
    key = RunKeys(run).windows
    found = [text(k) for k in r.hkeys(key)]
    stale = [k for k in found if int(k) >= number]
    if stale:
        r.hdel(key, *stale)
