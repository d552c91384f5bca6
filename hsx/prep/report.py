"""What tokenising produced: each row's result, the samples kept, and the counts of every row read (kept,
dropped, rejected by reason)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hsx.printable import printable

EXAMPLES_KEPT = 20      # rejected rows quoted in a report; all are counted


class TokenisedRow(NamedTuple):
    """A row a tokenising process encoded (sent back to the producer, which applies the window's policies)."""

    index: int               # the row's 0-based position in the dataset
    sample_id: str
    input_ids: np.ndarray    # int32
    loss_mask: np.ndarray    # uint8
    source_format: str       # openai | sharegpt | pretokenised | ... (rows by format)
    source: str = ""         # a mixture's source (hsx.prep.mixture); "" for a single dataset


class RejectedRow(NamedTuple):
    """A row a tokenising process could not read or encode."""

    index: int               # the row's 0-based position in the dataset
    row_id: str | None       # its id, if it had one that could be read
    code: str                # the short reason (counted)
    message: str             # the reason in words (quoted in the report's examples)
    source_format: str
    source: str = ""         # a mixture's source; "" for a single dataset


@dataclass(frozen=True)
class Sample:
    """A kept sample: a row's tokens after the window's policies (max length, overlong, duplicate ids)."""

    sample_id: str
    input_ids: np.ndarray   # int32
    loss_mask: np.ndarray   # uint8


@dataclass
class TokeniseReport:
    """Counts over the rows read. ``rejected``: reason code -> rows; ``formats``: source format -> rows."""

    rows: int = 0
    kept: int = 0
    truncated: int = 0          # kept after cutting to --max-length (one rejected after its cut is not counted)
    dropped_overlong: int = 0
    duplicate_ids: int = 0
    turn_rows: int = 0          # --per-turn: rows made into one sample a turn (kept, truncated, dropped_overlong
                                # and no_assistant_token_after_truncation then count samples)
    rejected: Counter = field(default_factory=Counter)
    formats: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)      # "row 12 (id x): reason", row numbers 1-based; printable

    @property
    def rejected_rows(self) -> int:
        return sum(self.rejected.values())

    def reject_share(self) -> float:
        return self.rejected_rows / self.rows if self.rows else 0.0

    def note(self, index: int, row_id: str | None, message: str) -> None:
        if len(self.examples) < EXAMPLES_KEPT:
            where = f"row {index + 1}" + (f" (id {row_id})" if row_id is not None and row_id != str(index) else "")
            self.examples.append(printable(f"{where}: {message}"))   # row text: shown on one line, never obeyed

    def reject(self, index: int, row_id: str | None, code: str, message: str) -> None:
        self.rejected[code] += 1
        self.note(index, row_id, message)

    def merge(self, other: TokeniseReport) -> None:
        for name in ("rows", "kept", "truncated", "dropped_overlong", "duplicate_ids", "turn_rows"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rejected.update(other.rejected)
        self.formats.update(other.formats)
        self.examples.extend(other.examples[:max(EXAMPLES_KEPT - len(self.examples), 0)])

    def to_dict(self) -> dict:
        return {"rows": self.rows, "kept": self.kept, "truncated": self.truncated,
                "dropped_overlong": self.dropped_overlong, "duplicate_ids": self.duplicate_ids,
                **({"turn_rows": self.turn_rows} if self.turn_rows else {}),
                "rejected": dict(self.rejected), "formats": dict(self.formats), "examples": self.examples}

    @classmethod
    def from_dict(cls, d: dict) -> TokeniseReport:
        return cls(rows=d["rows"], kept=d["kept"], truncated=d["truncated"], dropped_overlong=d["dropped_overlong"],
                   duplicate_ids=d.get("duplicate_ids", 0), turn_rows=d.get("turn_rows", 0), rejected=Counter(d.get("rejected", {})),
                   formats=Counter(d.get("formats", {})),
                   examples=[printable(x) for x in d.get("examples", [])])   # from Redis: untrusted


@dataclass(frozen=True)
class Window:
    """One tokenised window: its samples in row order, and the counts of its rows."""

    number: int              # rows [number * window_rows, (number + 1) * window_rows)
    samples: list[Sample]
    report: TokeniseReport
    source: str = ""         # a mixture's source: every row of a window is of one source; "" for a single dataset
