"""When a run's batches were extracted and uploaded: the dashboard's throughput chart and the run it shows first.

The chart's data: tokens/s extracted and uploaded, in fixed time buckets.

Read from the run's ``spooled_log`` (a batch reached a spool = extracted) and
``done_log`` (verified in the store = uploaded) ZSETs, batch id scored by unix
time; a batch's tokens come from the plan. Bucket ``i`` covers
``[start + i * bucket, start + (i + 1) * bucket)``; values are tokens per second
averaged over the bucket. The last bucket of a live run is still filling.
"""

from __future__ import annotations

import math

import redis

from hsx.life import RunKeys
from hsx.redisconn import text

MIN_SPAN_SECONDS = 120  # a young run still gets a chart two minutes wide


def _last_score(r: redis.Redis, key: str) -> float | None:
    last = r.zrange(key, -1, -1, withscores=True)
    return last[0][1] if last else None


def _first_score(r: redis.Redis, key: str) -> float | None:
    first = r.zrange(key, 0, 0, withscores=True)
    return first[0][1] if first else None


def last_activity(r: redis.Redis, run: str) -> float:
    """Unix time the run's latest batch was uploaded or reached a spool (0.0: none yet)."""
    keys = RunKeys(run)
    return max(filter(None, (_last_score(r, keys.done_log), _last_score(r, keys.spooled_log))), default=0.0)


def throughput_series(r: redis.Redis, run: str, tokens_of: dict[str, int], now: float, complete: bool,
                      span_seconds: int, bucket_seconds: int) -> dict:
    """``{bucket_seconds, start, end, extracted_tokens_per_s: [...], uploaded_tokens_per_s: [...]}``.

    The chart ends now, or for a complete run at its last upload. It spans the
    run's history, between MIN_SPAN_SECONDS and ``span_seconds``.
    """
    keys = RunKeys(run)
    end = now
    if complete:
        end = _last_score(r, keys.done_log) or now
    end = math.floor(end / bucket_seconds) * bucket_seconds + bucket_seconds
    first = min(filter(None, (_first_score(r, keys.spooled_log), _first_score(r, keys.done_log))), default=end)
    span = min(max(end - first, MIN_SPAN_SECONDS), span_seconds)
    n = int(math.ceil(span / bucket_seconds))
    start = end - n * bucket_seconds
    out = {"bucket_seconds": bucket_seconds, "start": start, "end": end}
    for name, key in (("extracted_tokens_per_s", keys.spooled_log), ("uploaded_tokens_per_s", keys.done_log)):
        tokens = [0] * n
        for raw, ts in r.zrangebyscore(key, start, f"({end}", withscores=True):
            bid = text(raw)
            i = int((ts - start) // bucket_seconds)
            if 0 <= i < n:
                tokens[i] += tokens_of.get(bid, 0)
        out[name] = [t / bucket_seconds for t in tokens]
    return out
