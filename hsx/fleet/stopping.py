"""How a role stops: its own bound, and a stop while Redis is away.

StopDeadline: still running ``seconds`` after its stop request, a role exits anyway.

Every wait of a stopping role ends at once (hsx.retry.STOP: back-offs, pauses, Redis ride-outs), the job in hand
finishes and a worker's writes get their --grace-seconds; this is what holds the bound if something else does
not. It says where each thread was (faulthandler, to stderr) and one line naming the role, then exits 1 at once
(os._exit: a thread that hangs cannot hold the exit up). Nothing is lost: a batch in hand comes back through its
lease, as after a SIGKILL. It replaced the SLURM recipe's second SIGTERM, a backstop for a worker hang that had
never been root-caused: a hang now leaves its stack in the log.

After rq's work loop, a stop request is no error and a second is still rq's cold shutdown: hsx/fleet/rqworker.py.

A daemon thread polls the stop flag (every POLL_SECONDS; the flag is set from a signal handler, where starting a
thread or taking a lock could wait on itself) until the role's serve() ends and disarms it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time

from hsx import retry
from hsx.redisconn import AWAY_ERRORS

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5   # s: how soon the deadline's clock starts after a stop request


class StopDeadline:
    def __init__(self, what: str, seconds: float):
        self.what, self.seconds = what, seconds
        self._disarmed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hsx-stop-deadline", daemon=True)

    def arm(self) -> StopDeadline:
        self._thread.start()
        return self

    def disarm(self) -> None:
        """serve() returned: the process exits (or, in-process, goes on) on its own."""
        self._disarmed.set()

    def _watch(self) -> None:
        while not retry.STOP.is_set():
            if self._disarmed.wait(POLL_SECONDS):
                return
        if self._disarmed.wait(self.seconds):
            return
        log.error("%s still running %.0f s after its stop request: exiting now (a batch in hand comes back through "
                  "its lease); where each thread was follows on stderr", self.what, self.seconds)
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        time.sleep(0.1)
        os._exit(1)


@contextlib.contextmanager
def stopped_without_redis(role):
    """Stopping while Redis is away (or full): its calls no longer wait (hsx/redisconn.py) and raise; the role
    stops without it, said once, and exits 0. Any other error, or one while not stopping, goes on up."""
    try:
        yield
    except AWAY_ERRORS as exc:
        if not retry.STOP.is_set():
            raise
        if not role.left_redis:
            role.left_redis = True
            log.warning("%s %s stops without Redis (%s: %s): a batch in hand comes back through its lease",
                        role.noun, role.name, type(exc).__name__, str(exc).splitlines()[0][:200])


RQ_RETRY_LINE = "could not connect to Redis instance"   # rq's own line, every 2 s (its pubsub thread) while away


class _QuietWhenStoppingWithoutRedis(logging.Filter):
    """rq's "found an unhandled exception, quitting..." and its traceback, for a Redis error of a role that stops
    while Redis is away: stopped_without_redis says that in one line instead. And rq's "could not connect to Redis
    instance ... retrying" lines, at any time: its pubsub thread writes one every 2 s for as long as Redis is away,
    where the role's own connection says the loss and the return once each (hsx/redisconn.py)."""

    @staticmethod
    def away(error: BaseException | None) -> bool:
        return isinstance(error, AWAY_ERRORS)

    def filter(self, record: logging.LogRecord) -> bool:
        if RQ_RETRY_LINE in str(record.msg):
            return False
        return not (retry.STOP.is_set() and self.away(record.exc_info[1] if record.exc_info else None))


QUIET_RQ = _QuietWhenStoppingWithoutRedis()
