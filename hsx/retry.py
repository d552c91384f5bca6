"""Exponential backoff with full jitter, for calls to Redis and the store."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def backoff_delay(k: int, base_seconds: float = 0.5, cap_seconds: float = 30.0) -> float:
    """Sleep before try ``k + 1`` (k = failures so far): uniform in [0, min(cap, base * 2**k)] (full jitter)."""
    return random.uniform(0, min(cap_seconds, base_seconds * 2**k))


def backoff_delays(attempts: int, base_seconds: float = 0.5, cap_seconds: float = 30.0):
    """Yield ``attempts - 1`` sleep times: uniform in [0, min(cap, base * 2**k)]."""
    for k in range(attempts - 1):
        yield backoff_delay(k, base_seconds, cap_seconds)


def retry_call(fn: Callable[[], T], what: str, retry_on: tuple[type[BaseException], ...], attempts: int,
               base_seconds: float = 0.5, cap_seconds: float = 30.0) -> T:
    """Call ``fn`` until it returns, retrying ``retry_on`` errors with backoff; re-raise the last."""
    delays = backoff_delays(attempts, base_seconds, cap_seconds)
    while True:
        try:
            return fn()
        except retry_on as exc:
            delay = next(delays, None)
            if delay is None:
                raise
            log.warning("%s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, delay)
            time.sleep(delay)
