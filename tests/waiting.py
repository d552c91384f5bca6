"""Waiting on a condition without a fixed wall-clock window (issue 18 item 4).

A loaded 2-core machine can take several times as long as a quiet one, so a test that waits for
something that advances step by step (a run's batches) polls for it and gives up only when nothing
advanced for ``idle_seconds``, or after ``cap_seconds`` in all.
"""

from __future__ import annotations

import time


class ProgressDeadline:
    """``expired(snapshot)``: True once ``snapshot`` (anything comparable with ==) has not changed for
    ``idle_seconds``, or ``cap_seconds`` have passed since the start."""

    def __init__(self, idle_seconds: float, cap_seconds: float):
        self.idle_seconds = idle_seconds
        self.start = self.moved_at = time.monotonic()
        self.cap = self.start + cap_seconds
        self.last = None

    def expired(self, snapshot) -> bool:
        now = time.monotonic()
        if snapshot != self.last:
            self.last, self.moved_at = snapshot, now
        return now - self.moved_at > self.idle_seconds or now > self.cap

    def __str__(self) -> str:
        now = time.monotonic()
        return (f"waited {now - self.start:.0f} s; last change {now - self.moved_at:.0f} s ago "
                f"(gives up after {self.idle_seconds:.0f} s without one), last seen {self.last!r}")
