"""One producer a run: a Redis lock with a TTL that the holder keeps refreshing (``Run.producer_lock``).

The lock is ``hsx:<run>:producer_lock`` (STRING, the holder's random token,
PX TTL). Expiry is Redis' own clock, so host clocks do not matter. The holder
refreshes it every TTL / 3 from a thread; a producer that stops (killed,
paused past the TTL) loses it and a second one may take over. A lock that names
a process of this host that no longer runs is taken over at once. Enqueueing is
guarded by WATCH on the lock key (``guarded_pipeline``): a holder that lost
the lock between two windows cannot enqueue another batch.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time

import redis

from hsx.errors import HsxError
from hsx.life.keys import RunKeys
from hsx.pids import gone_here

log = logging.getLogger(__name__)
LOCK_TTL_MS = 30_000   # a dead producer's lock frees itself after this long

# KEYS: lock ; ARGV: token, ttl_ms. 1 if the caller still holds the lock (TTL renewed), else 0.
_REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS: lock ; ARGV: token. Deletes the lock only if the caller holds it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ProducerBusy(HsxError, RuntimeError):
    """Another producer holds this run."""


class LockLost(HsxError, RuntimeError):
    """This producer's lock expired or was taken; it must stop enqueueing."""


class ProducerLock:
    def __init__(self, r: redis.Redis, run: str, wait_seconds: float = 0.0, ttl_ms: int = LOCK_TTL_MS):
        self.r, self.run, self.key = r, run, RunKeys(run).producer_lock
        self.wait_seconds, self.ttl_ms = wait_seconds, ttl_ms
        self.token = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "nonce": secrets.token_hex(8)})
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ProducerLock:
        deadline = time.monotonic() + self.wait_seconds
        waited = False
        while not self.r.set(self.key, self.token, nx=True, px=self.ttl_ms):
            holder = self.r.get(self.key)
            if holder is not None and _holder_gone(holder) and self.r.eval(_RELEASE, 1, self.key, holder):
                log.warning("run %s: the producer %s holding its lock is gone (killed?); took the lock over",
                            self.run, _describe(holder))
                continue
            if time.monotonic() >= deadline:
                raise ProducerBusy(
                    f"another producer is working on run {self.run!r} ({_describe(holder)}); two at once would "
                    "enqueue every batch twice. Wait for it to finish (or for its lock to expire "
                    f"{self.ttl_ms / 1000:.0f} s after it stopped), or pass --lock-wait SECONDS to wait")
            if not waited:
                log.info("run %s: waiting for the producer %s to finish", self.run, _describe(holder))
                waited = True
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.05)))
        self._thread = threading.Thread(target=self._refresh_loop, name=f"producer-lock-{self.run}", daemon=True)
        self._thread.start()
        return self

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not self.r.eval(_REFRESH, 1, self.key, self.token, self.ttl_ms):
                    self._lost.set()
                    log.error("run %s: the producer lock was lost; stopping before the next enqueue", self.run)
                    return
            except redis.RedisError as exc:   # the guarded enqueue re-checks; a short outage is not a loss
                log.warning("run %s: could not refresh the producer lock (%s)", self.run, exc)

    def check(self) -> None:
        """Raise LockLost unless this producer still holds the lock."""
        if self._lost.is_set() or self.r.get(self.key) != self.token.encode():
            raise LockLost(f"run {self.run!r}: this producer no longer holds the run's lock (it expired or another "
                           "producer took it); stopped before enqueueing more. Re-run produce to resume.")

    def guarded_pipeline(self):
        """A transactional pipeline that fails (WatchError) if the lock changes before it executes."""
        pipe = self.r.pipeline(transaction=True)
        pipe.watch(self.key)
        if pipe.get(self.key) != self.token.encode():
            pipe.reset()
            raise LockLost(f"run {self.run!r}: this producer no longer holds the run's lock; stopped before "
                           "enqueueing more. Re-run produce to resume.")
        pipe.multi()
        return pipe

    def execute(self, pipe) -> list:
        """Run a ``guarded_pipeline``; LockLost (nothing of it applied) if the lock changed hands meanwhile."""
        try:
            return pipe.execute()
        except redis.WatchError:
            raise LockLost(f"run {self.run!r}: the run's lock changed hands while enqueueing; nothing of this "
                           "window was enqueued by this producer. Re-run produce to resume.") from None

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        try:
            self.r.eval(_RELEASE, 1, self.key, self.token)
        except redis.RedisError as exc:
            log.warning("run %s: could not release the producer lock (%s); it expires by itself", self.run, exc)


def _holder_gone(raw) -> bool:
    """True where the lock names a process of this host that no longer runs: a producer killed before it could
    release it (SIGKILL, OOM), whose lock would otherwise refuse the same command for the rest of its TTL."""
    try:
        holder = json.loads(raw)
    except (TypeError, ValueError):
        return False
    # this process's own pid is alive: a second produce() of this process (a thread) must not take its first's lock
    return isinstance(holder, dict) and gone_here(holder.get("host"), holder.get("pid"))


def _describe(raw) -> str:
    try:
        holder = json.loads(raw)
        return f"pid {holder['pid']} on {holder['host']}"
    except (TypeError, ValueError, KeyError):
        return "holder unknown"
