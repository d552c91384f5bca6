"""Waiting in tests without fixed wall-clock windows.

A test waits for a condition (polled), never for a fixed time. Its limit is a stall limit: it is
stretched by ``time_scale()`` (how much slower this machine is now than a quiet 2-core box), and a
wait that watches a ``progress`` value starts its clock again each time that value changes, so a
loaded machine that is slow but moving never fails a test, and a stuck run still fails in bounded time.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Seconds a 2-core machine of CI's kind spends in _calibration_work (measured here: 0.037-0.039 s).
REFERENCE_SECONDS = 0.04
MAX_SCALE = 10.0


def _calibration_work() -> float:
    start = time.perf_counter()
    total = 0
    for i in range(600_000):
        total += i * i % 7
    return time.perf_counter() - start


@functools.cache
def time_scale() -> float:
    """>= 1: the factor by which waits are stretched on this machine now.

    HSX_TEST_TIME_SCALE overrides it; otherwise the larger of a short CPU calibration against
    REFERENCE_SECONDS and the 1-minute load average per core, capped at MAX_SCALE."""
    if os.environ.get("HSX_TEST_TIME_SCALE"):
        return max(1.0, float(os.environ["HSX_TEST_TIME_SCALE"]))
    measured = min(_calibration_work() for _ in range(3))
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return min(MAX_SCALE, max(1.0, measured / REFERENCE_SECONDS, load))


def scaled(seconds: float) -> float:
    """``seconds`` stretched by time_scale()."""
    return seconds * time_scale()


def wait_until(what: str, predicate: Callable[[], T], stall_seconds: float, *, interval: float = 0.2,
               progress: Callable[[], Any] | None = None, check: Callable[[], None] | None = None,
               describe: Callable[[], str] | None = None, retry_on: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``predicate`` until it returns a true value, and return that value.

    Fails after ``scaled(stall_seconds)`` without success; when ``progress`` is given, that clock
    restarts whenever ``progress()`` returns a new value. ``check`` runs each round (e.g. "the
    processes are alive") and may raise; exceptions in ``retry_on`` from predicate/progress count as
    "not yet". ``describe`` adds context (logs) to the failure message."""
    limit = scaled(stall_seconds)
    started = last_change = time.monotonic()
    last_seen: Any = object()
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            if progress is not None:
                seen = progress()
                if seen != last_seen:
                    last_seen, last_change = seen, time.monotonic()
        except retry_on as exc:
            last_error = exc
        if check is not None:
            check()
        now = time.monotonic()
        if now - last_change > limit:
            moving = f", progress stalled at {last_seen!r}" if progress is not None else ""
            extra = f"\n{describe()}" if describe else ""
            raise AssertionError(f"timed out waiting for {what}: no success within {limit:.0f}s "
                                 f"(time scale {time_scale():.1f}, {now - started:.0f}s in all{moving}; "
                                 f"last error: {last_error}){extra}")
        time.sleep(interval)


def exits_fail(proc, what: str, log_path) -> Callable[[], None]:
    """A ``check`` for wait_until: raise, with the end of its log, once the process ``proc`` has exited."""
    def check() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {Path(log_path).read_text()[-500:]}")
    return check


class ProgressDeadline:
    """For loops that do more each round than poll: ``expired(snapshot)`` is True once ``snapshot``
    (anything comparable with ==) has not changed for ``scaled(idle_seconds)``, or ``cap_seconds``
    (also scaled) have passed since the start."""

    def __init__(self, idle_seconds: float, cap_seconds: float):
        self.idle_seconds = scaled(idle_seconds)
        self.start = self.moved_at = time.monotonic()
        self.cap = self.start + scaled(cap_seconds)
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
