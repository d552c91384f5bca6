"""Counts kept a minute at a time in a run's ``rate_minutes`` HASH, summed over a window: rates in O(minutes).

A field is ``<prefix>:<unix minute>:<what>`` (hsx/life/keys.py names the prefixes: ``spooled``, ``done``,
``up:<host>``); the oldest minute of a window counts by the share of it inside the window.
"""

from __future__ import annotations

import redis


def window_counts(r: redis.Redis, key: str, prefix: str, whats: str, now: float, window: float) -> list[int]:
    """The sums of ``<prefix>:<minute>:<what>`` for each ``what`` in ``whats`` over the last ``window`` s (one
    HMGET); a field that is not a count adds nothing."""
    start = now - window
    minutes = range(int(start // 60), int(now // 60) + 1)
    raw = r.hmget(key, [f"{prefix}:{m}:{what}" for m in minutes for what in whats])
    totals = [0.0] * len(whats)
    for i, m in enumerate(minutes):
        share = min(max(((m + 1) * 60 - start) / 60, 0.0), 1.0)
        for j in range(len(whats)):
            try:
                totals[j] += share * int(raw[len(whats) * i + j] or 0)
            except ValueError:
                pass   # not a count: adds nothing
    return [round(t) for t in totals]
