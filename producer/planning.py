"""A run being planned by `hsx produce`: what resuming found, and what planning has added since.

One object a producer call, made under the run's producer lock (hsx/life/producerlock.py) and passed through its
steps (producer/produce.py); it ends as the ProduceReport.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from hsx import life
from hsx.prep import TokeniseReport
from hsx.runspec import Manifest, ProduceConfig
from hsx.store import Store
from producer.report import ProduceReport
from producer.windows import WindowRecord


@dataclass
class Planning:
    """A run being planned under its producer lock: what resuming found, and what planning added since."""

    r: redis.Redis
    store: Store
    cfg: ProduceConfig
    lock: life.ProducerLock
    done: set[str] = field(default_factory=set)      # batch ids the ledger holds done (gains those rebuilt)
    pending: set[str] = field(default_factory=set)   # batch ids on a queue (extract or upload); gains those enqueued
    rebuild: life.Rebuild | None = None   # a re-run: stored objects the ledger lacks are checked and recorded done
    suspect: frozenset[str] = frozenset()   # batches whose inputs a worker found corrupt: checked by their bytes
    seen: set[str] = field(default_factory=set)      # sample ids of the resumed windows (duplicate check)
    planned_only: bool = False
    repaired: int = 0                # recorded done but missing from the store: re-enqueued
    first_pending: int = 0           # batches pending when this producer started
    resumed_windows: int = 0         # windows an earlier producer recorded
    new_windows: int = 0             # windows this producer recorded
    report: TokeniseReport = field(default_factory=TokeniseReport)
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    computed_tokens: int = 0         # what the GPU computes: padded tokens, each shared prefix once
    enqueued: int = 0
    manifest_saved: bool = False
    sources: dict[str, dict[str, int]] = field(default_factory=dict)   # a mixture's: name -> rows, rejected, samples, tokens, batches
    run: life.Run = field(init=False)   # the run's handle in Redis

    def __post_init__(self) -> None:
        self.run = life.Run(self.r, self.cfg.run)

    def add(self, rec: WindowRecord, resumed: bool) -> None:
        if rec.source:
            counts = self.sources.setdefault(rec.source, dict.fromkeys(("rows", "rejected", "samples", "tokens",
                                                                        "batches"), 0))
            for name, n in (("rows", rec.report.rows), ("rejected", rec.report.rejected_rows),
                            ("samples", rec.samples), ("tokens", rec.tokens), ("batches", rec.batches)):
                counts[name] += n
        self.batches += rec.batches
        self.samples += rec.samples
        self.tokens += rec.tokens
        self.padded_tokens += rec.padded_tokens
        self.computed_tokens += rec.computed_tokens or rec.padded_tokens
        if resumed:
            self.report.merge(rec.report)
            self.resumed_windows += 1
            self.manifest_saved = True
        else:
            self.new_windows += 1

    def totals(self, planning: int) -> dict[str, int]:
        """The run's totals (Redis ``hsx:<run>:totals``); ``planning``: 1 while windows are still to come."""
        report = self.report
        return {"batches": self.batches, "samples": self.samples, "tokens": self.tokens,
                "padded_tokens": self.padded_tokens, "computed_tokens": self.computed_tokens, "planning": planning, "rows": report.rows,
                "truncated": report.truncated, "dropped_overlong": report.dropped_overlong,
                "rejected": report.rejected_rows}

    def produce_report(self, manifest: Manifest) -> ProduceReport:
        return ProduceReport(self.cfg.run, manifest, self.report, self.batches, self.samples, self.tokens,
                             self.padded_tokens, len(self.done), self.first_pending, self.enqueued, self.repaired,
                             windows=self.resumed_windows + self.new_windows, resumed_windows=self.resumed_windows,
                             rebuilt=len(self.rebuild.rebuilt) if self.rebuild is not None else 0,
                             planned_only=self.planned_only, sources=self.sources,
                             computed_tokens=self.computed_tokens)
