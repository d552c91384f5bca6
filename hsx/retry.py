"""Exponential backoff with full jitter, for calls to Redis and the store; every wait ends when a stop is asked.

``STOP`` is this process's stop request: a role sets it on its first SIGTERM / SIGINT (hsx/fleet/role.py), and
every back-off and pause of a role waits on it (``pause``), so a stopping process never sits out a
back-off (an uploader took 16-27 s to exit during a 30 s pause).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
PAUSE_POLL_SECONDS = 0.1  # s: how soon a pause sees a stop request


class StopRequest:
    """A flag set from a signal handler: a plain attribute, no lock (``threading.Event.set`` takes one, and a
    handler that interrupts its own thread inside that lock would wait on itself for ever)."""

    def __init__(self):
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set


STOP = StopRequest()  # set: this process was asked to stop; cleared when a role starts serving


def pause(seconds: float) -> bool:
    """Wait ``seconds``, or less when a stop is asked (seen within PAUSE_POLL_SECONDS); True if it was (the
    caller stops waiting for good)."""
    deadline = time.monotonic() + max(seconds, 0.0)
    while not STOP.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(left, PAUSE_POLL_SECONDS))
    return True


def backoff_delay(k: int, base_seconds: float = 0.5, cap_seconds: float = 30.0) -> float:
    """Sleep before try ``k + 1`` (k = failures so far): uniform in [0, min(cap, base * 2**k)] (full jitter)."""
    return random.uniform(0, min(cap_seconds, base_seconds * 2**k))


def backoff_delays(attempts: int, base_seconds: float = 0.5, cap_seconds: float = 30.0):
    """Yield ``attempts - 1`` sleep times: uniform in [0, min(cap, base * 2**k)]."""
    for k in range(attempts - 1):
        yield backoff_delay(k, base_seconds, cap_seconds)


def retry_call(fn: Callable[[], T], what: str, retry_on: tuple[type[BaseException], ...], attempts: int,
               base_seconds: float = 0.5, cap_seconds: float = 30.0) -> T:
    """Call ``fn`` until it returns, retrying ``retry_on`` errors with backoff; re-raise the last (at once
    when a stop is asked: no back-off is sat out by a stopping process)."""
    delays = backoff_delays(attempts, base_seconds, cap_seconds)
    while True:
        try:
            return fn()
        except retry_on as exc:
            delay = next(delays, None)
            if delay is None or STOP.is_set():
                raise
            log.warning("%s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, delay)
            if pause(delay):
                raise
