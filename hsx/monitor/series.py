"""When a run's batches were extracted and uploaded: the dashboard's throughput chart and the run it shows first.

The chart's data: tokens/s extracted and uploaded, in fixed time buckets.

Read from the run's ``spooled_log`` (a batch reached a spool = extracted) and
``done_log`` (verified in the store = uploaded) ZSETs, batch id scored by unix
time, a batch's tokens from the plan; each log keeps the last LOG_KEEP batches,
so what is older than a log's oldest entry comes from the run's
per-minute token counts (``rate_minutes``), spread evenly over the minute.
Bucket ``i`` covers ``[start + i * bucket, start + (i + 1) * bucket)``; values
are tokens per second averaged over the bucket. The last bucket of a live run
is still filling.
"""

from __future__ import annotations

import math

import redis

from hsx.life import RunKeys
from hsx.monitor.planstate import plan_tokens
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


def _mark(r: redis.Redis, run: str, field: str) -> float | None:
    raw = r.hget(RunKeys(run).rate_minutes, field)
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def throughput_series(r: redis.Redis, run: str, tokens_of: dict[str, int] | None, now: float, complete: bool,
                      span_seconds: int, bucket_seconds: int, malformed: list[str] | None = None) -> dict:
    """``{bucket_seconds, start, end, extracted_tokens_per_s: [...], uploaded_tokens_per_s: [...]}``.

    The chart ends now, or for a complete run at its last upload. It spans the
    run's history, between MIN_SPAN_SECONDS and ``span_seconds``. ``tokens_of``:
    batch id -> tokens where the caller holds the plan (else the logs' batches'
    plan entries are read: at most 2 x LOG_KEEP; one that is not a record is
    named in ``malformed``).
    """
    keys = RunKeys(run)
    end = now
    if complete:
        end = _mark(r, run, "done:last") or _last_score(r, keys.done_log) or now
    end = math.floor(end / bucket_seconds) * bucket_seconds + bucket_seconds
    firsts = [_mark(r, run, "spooled:first"), _mark(r, run, "done:first"),
              _first_score(r, keys.spooled_log), _first_score(r, keys.done_log)]
    first = min(filter(None, firsts), default=end)
    span = min(max(end - first, MIN_SPAN_SECONDS), span_seconds)
    n = int(math.ceil(span / bucket_seconds))
    start = end - n * bucket_seconds
    out = {"bucket_seconds": bucket_seconds, "start": start, "end": end}
    for name, key, kind in (("extracted_tokens_per_s", keys.spooled_log, "spooled"),
                            ("uploaded_tokens_per_s", keys.done_log, "done")):
        tokens = [0.0] * n
        logged = [(text(raw), ts) for raw, ts in r.zrangebyscore(key, start, f"({end}", withscores=True)]
        if tokens_of is None:
            found = plan_tokens(r, run, [bid for bid, _ in logged], [] if malformed is None else malformed)
        for bid, ts in logged:
            i = int((ts - start) // bucket_seconds)
            if 0 <= i < n:
                tokens[i] += (tokens_of if tokens_of is not None else found).get(bid, 0)
        oldest, first_mark = _first_score(r, key), _mark(r, run, f"{kind}:first")
        if oldest is not None and first_mark is not None and first_mark < math.floor(oldest):
            _spread_minutes(r, keys.rate_minutes, kind, tokens, start, min(oldest, end), bucket_seconds)
        out[name] = [t / bucket_seconds for t in tokens]
    return out


def _spread_minutes(r: redis.Redis, key: str, kind: str, tokens: list[float], start: float, until: float,
                    bucket_seconds: int) -> None:
    """Add to ``tokens`` (buckets from ``start``) the minute counts of ``kind`` before ``until`` (what the log no
    longer holds), each minute's tokens spread evenly over it."""
    if until <= start:
        return
    minutes = list(range(int(start // 60), int(until // 60) + 1))
    counts = r.hmget(key, [f"{kind}:{m}:t" for m in minutes])
    for m, raw in zip(minutes, counts, strict=True):
        try:
            total = int(raw or 0)
        except ValueError:
            continue   # not a count: adds nothing
        lo, hi = max(m * 60, start), min(m * 60 + 60, until)
        t = lo
        while total and t < hi:
            i = int((t - start) // bucket_seconds)
            edge = min(start + (i + 1) * bucket_seconds, hi)
            if 0 <= i < len(tokens):
                tokens[i] += total * (edge - t) / 60
            t = edge
