"""What `hsx produce` did: the run's plan, the rows read and the queue, as lines for the terminal."""

from __future__ import annotations

from dataclasses import dataclass, field

from hsx.prep import TokeniseReport
from hsx.runspec import Manifest


@dataclass
class ProduceReport:
    run: str
    manifest: Manifest
    tokenise: TokeniseReport
    batches: int
    samples: int
    tokens: int
    padded_tokens: int
    already_done: int
    already_pending: int
    enqueued: int
    repaired: int = 0
    windows: int = 0
    resumed_windows: int = 0
    rebuilt: int = 0
    planned_only: bool = False
    sources: dict = field(default_factory=dict)   # a mixture's: name -> {rows, rejected, samples, tokens, batches}
    computed_tokens: int = 0   # what the GPU computes, each shared prefix once (0: padded_tokens)

    def lines(self) -> list[str]:
        t = self.tokenise
        out = [f"run {self.run}: {t.rows} rows read, {t.kept} samples kept"
               + (f" (one a turn of {t.turn_rows} rows, --per-turn)" if t.turn_rows else "") + f", {t.truncated} truncated, "
               f"{t.dropped_overlong} dropped as over-long, {t.rejected_rows} rejected ({t.reject_share():.2%})",
               "rows by format: " + ", ".join(f"{k} {v}" for k, v in sorted(t.formats.items())),
               f"plan: {self.batches} batches, {self.tokens} tokens, padding {1 - self.tokens / max(self.padded_tokens, 1):.2%} "
               f"of {self.padded_tokens} padded tokens; {self.tokens} stored, "
               f"{self.computed_tokens or self.padded_tokens} computed"
               + (f" (shared prefixes once, spines of >= {self.manifest.prefix_min_tokens} tokens, where a tree saves "
                  f"more than {self.manifest.forward_tokens} tokens a forward)"
                  if self.manifest.prefix_reuse == "on" else " (--prefix-reuse off)"),
               f"windows: {self.windows}" + (f" ({self.resumed_windows} done by an earlier producer, skipped)"
                                             if self.resumed_windows else ""),
               f"queue: {self.enqueued} batches enqueued, {self.already_done} already done, {self.already_pending} already pending"
               + (f", {self.repaired} recorded done but missing from the store (re-enqueued)" if self.repaired else "")
               + (f", {self.rebuilt} recorded done from verified objects in the store (ledger rebuilt)"
                  if self.rebuilt else "")]
        for name, c in self.sources.items():
            out.append(f"  source {name}: {c['rows']} rows read, {c['rejected']} rejected, {c['samples']} samples, "
                       f"{c['tokens']} tokens, {c['batches']} batches")
        if self.planned_only:
            out.append(f"planned only: no process enqueues run {self.run} until you start it with this `hsx produce` "
                       "command without --no-enqueue")
        for kind, count in t.rejected.most_common():
            out.append(f"  rejected {count} x {kind}")
        out.extend(f"  {example}" for example in t.examples)
        return out
