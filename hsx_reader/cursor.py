"""A follower's place in a run's done sequence: ``POSITION:ROW@GENERATION/BATCH`` (hsx_reader.follow)."""

from __future__ import annotations

from dataclasses import dataclass

from hsx.store import layout
from hsx_reader.run import ReaderError


@dataclass(frozen=True)
class Cursor:
    """A place in the followed stream: batch ``position`` of the ledger's sequence, ``row`` samples of it read."""

    position: int = 0
    row: int = 0
    generation: str = ""     # the done_seq the position was counted in ("": not known, not checked)
    last: str = ""           # batch id of the last sample read: at ``anchor`` ("": not known, not checked)

    @property
    def anchor(self) -> int:
        """The position of the batch ``last`` names: this one when rows of it were read, else the one before."""
        return self.position if self.row else self.position - 1

    def __str__(self) -> str:
        return (f"{self.position}:{self.row}" + (f"@{self.generation}" if self.generation else "")
                + (f"/{self.last}" if self.last else ""))

    @classmethod
    def parse(cls, value: str | Cursor | None) -> Cursor:
        if value is None:
            return cls()
        if isinstance(value, Cursor):
            return value
        rest, _, last = str(value).partition("/")
        place, _, generation = rest.partition("@")
        try:
            position, row = (int(x) for x in place.split(":"))
        except ValueError:
            raise ReaderError(f"cursor {value!r} is not POSITION:ROW[@GENERATION[/BATCH]] (the 'cursor' of a "
                              "sample)") from None
        if position < 0 or row < 0:
            raise ReaderError(f"cursor {value!r} has a negative part")
        if last and (position, row) == (0, 0):
            raise ReaderError(f"cursor {value!r} names a batch read before position 0")
        if last:
            try:
                layout.segment(last, "the cursor's batch id")
            except ValueError as exc:
                raise ReaderError(f"cursor {value!r}: {exc}") from None
        return cls(position, row, generation, last)
