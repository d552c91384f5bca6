"""rq job functions of the tally role."""

from __future__ import annotations

from tests.toyrole.runtime import TallyRuntime


def add(run: str, n: int) -> int:
    return TallyRuntime.current().add(n)
