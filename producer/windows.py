"""The producer's progress through the dataset, in Redis: one record a planned window.

A window's record (``hsx:<run>:windows``, window number -> JSON, kept by ``hsx.life``'s
``save_window``, ``window_records`` and ``forget_windows_from``) is written
last, after its inputs are in the store, its batches in the plan and its jobs
on the queue. A producer that was killed resumes after the last contiguous
recorded window; a window it had half done is planned again, to the same
batch ids (deterministic), and its jobs already queued are not queued again.

A record is compact JSON, keys sorted (every hsx since windows wrote these bytes):
``{"batches":4,"enqueued":4,"first_batch":0,"padded_tokens":...,"padding":0.01,"report":{...},
"samples":...,"tokens":...}``, ``report`` being TokeniseReport.to_dict(); a mixture's windows add ``"source"``
(its name: hsx status and the dashboard count each source's rows, samples and batches from these records).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hsx import life
from hsx.prep import TokeniseReport


@dataclass(frozen=True)
class WindowRecord:
    """A planned window: its batches are ``first_batch`` .. ``first_batch + batches - 1``."""

    first_batch: int      # index of its first batch
    batches: int
    samples: int
    tokens: int           # real tokens
    padded_tokens: int    # what the GPU computes (rows x padded length, summed)
    padding: float        # share of padded_tokens that is padding
    enqueued: int         # batches this window put on the queue (neither done nor pending before)
    report: TokeniseReport  # the counts of the window's rows
    source: str = ""        # a mixture's source (every row of a window is of one); "" (left out) for one dataset
    computed_tokens: int = 0  # what the GPU computes, shared prefixes once (0 in older records: padded_tokens)

    @property
    def end_batch(self) -> int:
        """Index of the first batch after this window's."""
        return self.first_batch + self.batches

    def to_json(self) -> str:
        return json.dumps({"first_batch": self.first_batch, "batches": self.batches, "samples": self.samples,
                           "tokens": self.tokens, "padded_tokens": self.padded_tokens, "padding": self.padding,
                           "enqueued": self.enqueued, "report": self.report.to_dict(),
                           **({"source": self.source} if self.source else {}),
                           **({"computed_tokens": self.computed_tokens}
                              if self.computed_tokens not in (0, self.padded_tokens) else {})},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> WindowRecord:
        d = json.loads(raw)
        return cls(first_batch=d["first_batch"], batches=d["batches"], samples=d["samples"], tokens=d["tokens"],
                   padded_tokens=d["padded_tokens"], padding=d["padding"], enqueued=d["enqueued"],
                   report=TokeniseReport.from_dict(d["report"]), source=str(d.get("source") or ""),
                   computed_tokens=d.get("computed_tokens") or d["padded_tokens"])


def load(run: life.Run) -> list[WindowRecord]:
    """Records of windows 0..k-1 (the contiguous prefix that was completed), in order."""
    found = run.window_records()
    records = []
    while len(records) in found:
        records.append(WindowRecord.from_json(found[len(records)]))
    return records


def record(run: life.Run, number: int, rec: WindowRecord) -> None:
    run.save_window(number, rec.to_json())


def withdraw(run: life.Run) -> int:
    """Take the plan back: queued jobs off the queue and out of the plan, the window records forgotten
    (``Run.withdraw``, a transition of each batch). Returns the number of jobs withdrawn."""
    return run.withdraw()


def forget_from(run: life.Run, number: int) -> None:
    """Forget the records of windows ``number`` and later: the next producer plans them again."""
    run.forget_windows_from(number)
