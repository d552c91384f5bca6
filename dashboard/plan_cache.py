"""Per-run plan summaries, read once: the plan of a run never changes after `hsx produce`.

A summary holds what the page shows of the plan as a whole: the planned batches of each shard. It is counted from
the producer's window records (each a range of batch indexes; a batch's shard is its index // the manifest's
batches_per_shard): O(windows), whatever the run's size (the plan of a 10M-sample run has ~280k entries).
A run whose windows do not account for its plan (planned by an hsx without window records, a record that is not
one, a plan taken back) is summed from its plan entries instead (O(run), and naming the malformed ones).

A summary is cached only once the plan is whole (as many batches as the run's planned ``batches`` total, no
window to go), so a page opened while the producer is still writing the plan reads it again next time.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import redis

from hsx import life
from hsx.monitor import plan_entries, planned_batches, window_spans
from hsx.runspec import ManifestError


@dataclass(frozen=True)
class PlanSummary:
    shard_batches: dict[str, int]  # shard -> planned batches
    batches: int                   # batches summed
    tokens: dict[str, int] | None = None   # batch id -> real (unpadded) tokens, where the plan entries were read
    samples: dict[str, int] | None = None  # batch id -> samples, likewise
    malformed: tuple[str, ...] = ()  # plan entries skipped (hsx.life.records): "<key> <batch>: why"

    @classmethod
    def read(cls, r: redis.Redis, run: str) -> PlanSummary:
        return cls.from_windows(r, run) or cls.from_entries(r, run)

    @classmethod
    def from_windows(cls, r: redis.Redis, run: str) -> PlanSummary | None:
        """From the window records (O(windows)); None where they do not account for the whole plan."""
        try:
            manifest = life.Run(r, run).manifest()
        except (ManifestError, ValueError):   # named as malformed by run_progress
            return None
        spans = window_spans(r, run)
        planned = planned_batches(r, run)
        if manifest is None or not spans or planned is None or spans[0].start != 0 or any(
                a.stop != b.start for a, b in zip(spans, spans[1:], strict=False)) or spans[-1].stop != planned:
            return None
        per = manifest.batches_per_shard
        shard_batches: Counter = Counter()
        for span in spans:
            for shard in range(span.start // per, (span.stop - 1) // per + 1):   # the shards it reaches
                lo, hi = max(span.start, shard * per), min(span.stop, (shard + 1) * per)
                if hi > lo:
                    shard_batches[f"{shard:05d}"] += hi - lo
        return cls(shard_batches=dict(shard_batches), batches=planned)

    @classmethod
    def from_entries(cls, r: redis.Redis, run: str) -> PlanSummary:
        """From every plan entry (O(run)): a run whose window records do not account for its plan."""
        malformed: list[str] = []
        specs = plan_entries(r, run, malformed)
        shard_batches: Counter = Counter()
        for spec in specs.values():
            shard_batches[spec["shard"]] += 1
        return cls(shard_batches=dict(shard_batches), batches=len(specs),
                   tokens={b: s["tokens"] for b, s in specs.items()}, samples={b: s["samples"] for b, s in specs.items()},
                   malformed=tuple(malformed))


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
        try:
            planning = life.Run(r, run).planning_in_progress()
        except ValueError:   # not a count: named by run_progress; not cached
            planning = True
        if planned is not None and planned == summary.batches and not planning:
            with self._lock:
                self._plans[run] = summary
        return summary
