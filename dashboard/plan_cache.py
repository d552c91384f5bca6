"""Per-run plan summaries, read once: the plan of a run never changes after `hsx produce`.

A summary is cached only once the plan is whole (as many specs as the run's
planned ``batches`` total), so a page opened while the producer is still
writing the plan reads it again next time.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import redis

from hsx.monitor import plan_entries, planned_batches


@dataclass(frozen=True)
class PlanSummary:
    tokens: dict[str, int]        # batch id -> real (unpadded) tokens
    samples: dict[str, int]       # batch id -> samples
    shard_batches: dict[str, int]  # shard -> planned batches
    shard_tokens: dict[str, int]   # shard -> planned tokens
    malformed: tuple[str, ...] = ()  # plan entries skipped (hsx.life.records): "<key> <batch>: why"

    @classmethod
    def read(cls, r: redis.Redis, run: str) -> PlanSummary:
        malformed: list[str] = []
        specs = plan_entries(r, run, malformed)
        shard_batches: Counter = Counter()
        shard_tokens: Counter = Counter()
        for spec in specs.values():
            shard_batches[spec["shard"]] += 1
            shard_tokens[spec["shard"]] += spec["tokens"]
        return cls(tokens={b: s["tokens"] for b, s in specs.items()}, samples={b: s["samples"] for b, s in specs.items()},
                   shard_batches=dict(shard_batches), shard_tokens=dict(shard_tokens), malformed=tuple(malformed))


class PlanCache:
    """Thread-safe run -> PlanSummary; the Flask server answers requests on several threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._plans: dict[str, PlanSummary] = {}

    def get(self, r: redis.Redis, run: str) -> PlanSummary:
        with self._lock:
            cached = self._plans.get(run)
        if cached is not None:
            return cached
        summary = PlanSummary.read(r, run)
        planned = planned_batches(r, run)  # a bad field: named by run_progress
        if planned is not None and planned == len(summary.tokens):
            with self._lock:
                self._plans[run] = summary
        return summary
