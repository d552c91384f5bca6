"""Exponential backoff with full jitter, for calls to Redis and the store; every wait ends when a stop is asked.

``STOP`` is this process's stop request: a role sets it on its first SIGTERM / SIGINT (hsx/role.py), and
every back-off and pause of a role waits on it (``pause``), so a stopping process never sits out a
back-off (issue 31 item 5: an uploader took 16-27 s to exit during a 30 s pause).
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
STOP = threading.Event()  # set: this process was asked to stop; cleared when a role starts serving


def pause(seconds: float) -> bool:
    """Wait ``seconds``, or less when a stop is asked; True if it was (the caller stops waiting for good)."""
    return STOP.wait(max(seconds, 0.0))


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
