"""Redis connections (with reconnect backoff) and a private redis-server when none is running."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.backoff import AbstractBackoff
from redis.exceptions import AuthenticationError, OutOfMemoryError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from hsx.defaults import DEFAULT_REDIS_CONNECT_SECONDS
from hsx.errors import HsxError
from hsx.pids import gone, stat_fields
from hsx.retry import backoff_delay, pause

log = logging.getLogger(__name__)


MASK = "***"
EXIT_MARGIN_SECONDS = 2.0  # s kept for printing the error and exiting, inside a command's wait for Redis
# Query parameters whose value is a secret (redis-py passes query parameters to the connection:
# ?password=, and sentinel/TLS variants): any name containing one of these words, any case.
_SECRET_PARAM = re.compile(r"(?i)(^|[&;])([^&;=]*(?:password|passwd|pwd|secret|token|auth)[^&;=]*)=([^&;]*)")


def redact(url: str) -> str:
    """The URL with every secret in it replaced by ***, for logs, pages and error messages.

    Covers a password in the userinfo (``redis://user:pw@host``, ``rediss://:pw@host``,
    ``unix://:pw@/path.sock``; a userinfo without ':' is masked whole, it may be a bare
    password) and password-like query parameters (``?password=pw``, ``&sentinel_password=``).
    Anything that does not parse as a URL is masked whole rather than shown.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:{MASK}@{hostport}" if colon else f"{MASK}@{hostport}"
    query = _SECRET_PARAM.sub(lambda m: f"{m.group(1)}{m.group(2)}={MASK}", parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    # Reassembled by hand: urlunsplit drops the '//' of an empty host (unix:///path.sock).
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


class _Backoff(AbstractBackoff):
    """redis-py's retry sleeps, computed the one hsx way (hsx.retry.backoff_delay: full jitter)."""

    def __init__(self, base_seconds: float = 0.5, cap_seconds: float = 10.0):
        self.base_seconds, self.cap_seconds = base_seconds, cap_seconds

    def compute(self, failures: int) -> float:
        return backoff_delay(max(failures - 1, 0), self.base_seconds, self.cap_seconds)


class _Outages:
    """Whether each Redis (by redacted URL) is down, or full, as this process sees it: one log line when it is
    lost, one when it is back with the outage's length, whichever thread or connection saw it first.

    Full: at its maxmemory with noeviction (the policy hsx requires), Redis refuses every command that may add
    memory ("OOM command not allowed") and executes nothing of it (a MULTI is refused whole, a script before its
    first write): a write refused is a write to make again, as after a lost connection, so it is ridden out the
    same way, named once as `maxmemory`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}
        self._full: set[str] = set()          # those of _since that refuse writes (maxmemory), not unreachable
        self._back_at: dict[str, float] = {}  # monotonic() when each Redis's last outage ended

    def lost(self, name: str, error: BaseException, since: float) -> None:
        with self._lock:
            if name in self._since:
                return
            self._since[name] = since
            full = isinstance(error, OutOfMemoryError)
            if full:
                self._full.add(name)
        if full:
            log.warning("Redis at %s refuses writes: its memory is at maxmemory and its policy is noeviction (%s); "
                        "waiting for room as long as it takes (raise its maxmemory or free memory), the work in hand "
                        "is kept", name, _reason(error))
        else:
            log.warning("Redis at %s lost (%s); waiting for it as long as it takes, the work in hand is kept", name,
                        _reason(error))

    def back(self, name: str) -> None:
        with self._lock:
            since = self._since.pop(name, None)
            full = name in self._full
            self._full.discard(name)
            if since is not None:
                self._back_at[name] = time.monotonic()
        if since is not None and full:
            log.warning("Redis at %s takes writes again after %.0f s", name, time.monotonic() - since)
        elif since is not None:
            log.warning("Redis at %s is back after an outage of %.0f s", name, time.monotonic() - since)

    def settling(self, url: str, seconds: float) -> bool:
        """Redis at ``url`` is down (or full), or came back less than ``seconds`` ago: other processes' leases and
        heartbeats expired while it was away and their owners may not have refreshed them yet, so this
        process reaps none (lease times are in Redis's clock, which ran on through the outage)."""
        name = redact(url)
        with self._lock:
            return name in self._since or time.monotonic() - self._back_at.get(name, float("-inf")) < seconds


OUTAGES = _Outages()
AWAY_ERRORS = (RedisConnectionError, RedisTimeoutError, OutOfMemoryError)  # what a ride-out waits through


class _RideOut(Retry):
    """Retry forever, with backoff (capped at 10 s), and report the outage through OUTAGES.

    A long-running role (worker, uploader) blocks inside the Redis call it was making, whatever its
    thread, and carries on when Redis answers again: no batch in hand is lost, no thread dies. The same for
    a Redis at its maxmemory (OutOfMemoryError: the write was not made). A process asked to stop
    (hsx.retry.STOP: SIGTERM) waits no more: the call raises its error, and the role exits within its bound.
    """

    def __init__(self, name: str):
        super().__init__(_Backoff(), -1,
                         supported_errors=(RedisConnectionError, RedisTimeoutError, OSError, OutOfMemoryError))
        self.name = name

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures, first_failure = 0, 0.0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if failures == 1:
                    first_failure = time.monotonic()
                # A pooled socket Redis closed (a restart): the reconnect alone may cure it, at once. Otherwise
                # wait first: fail() of a WATCHing pipeline raises WatchError, and its caller tries again at once.
                if failures > 1 or isinstance(error, OutOfMemoryError):
                    OUTAGES.lost(self.name, error, first_failure)
                    if pause(self._backoff.compute(failures - 1)):
                        fail(error, failures) if with_failure_count else fail(error)
                        raise
                fail(error, failures) if with_failure_count else fail(error)
                continue
            if failures:
                OUTAGES.back(self.name)
            return result


class RedisUnreachable(HsxError):
    """Redis did not answer when a command started."""


def connect(url: str, retries: int = 20, wait_seconds: float = DEFAULT_REDIS_CONNECT_SECONDS,
            ride_out: bool = False) -> redis.Redis:
    """A client that retries a dropped connection with backoff (full jitter under 0.5 s doubling, capped at 10 s).

    Redis must answer within ``wait_seconds`` now, else RedisUnreachable says where hsx looked
    (password masked) and what to check. Later outages: ``retries`` tries (about 3 minutes), or with
    ``ride_out`` (long-running roles) as long as they last, logged once when lost and once when back.
    """
    retry = _RideOut(redact(url)) if ride_out else Retry(_Backoff(), retries)
    client = redis.Redis.from_url(
        url, retry=retry,
        retry_on_error=[RedisConnectionError, RedisTimeoutError], health_check_interval=30,
        socket_connect_timeout=5, socket_keepalive=True)
    if wait_seconds > 0:
        check_reachable(url, wait_seconds)
    return client


def check_reachable(url: str, wait_seconds: float) -> None:
    """Ping ``url`` (once a second) until it answers or ``wait_seconds`` pass; raise RedisUnreachable then."""
    # Counted from the process's start, not from here: "within 10 s" is what a person measures at the prompt.
    deadline = time.monotonic() + max(wait_seconds - _process_age_seconds() - EXIT_MARGIN_SECONDS, 1.0)
    while True:
        # Every wait is cut to what is left: the answer comes within wait_seconds, not a probe timeout later.
        left = max(deadline - time.monotonic(), 0.1)
        probe = redis.Redis.from_url(url, socket_connect_timeout=min(2.0, left), socket_timeout=min(5.0, left))
        try:
            probe.ping()
            return
        except AuthenticationError as exc:
            raise RedisUnreachable(f"Redis at {redact(url)} refused the credentials ({exc}): check the user and "
                                   "password in HSX_REDIS_URL / REDIS_URL") from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if time.monotonic() >= deadline:
                raise RedisUnreachable(
                    f"cannot reach Redis at {redact(url)} ({_reason(exc)}) for {wait_seconds:.0f}s: check that "
                    "redis-server runs there, the host name and port, and HSX_REDIS_URL / REDIS_URL / --redis-url"
                ) from None
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
        except redis.exceptions.InvalidResponse as exc:  # something else listens there (an HTTP proxy, ...)
            raise RedisUnreachable(f"{redact(url)} answered, but not as Redis ({_reason(exc)}): check the host name "
                                   "and port in HSX_REDIS_URL / REDIS_URL / --redis-url") from None
        except redis.ResponseError as exc:
            raise RedisUnreachable(f"Redis at {redact(url)} answered with an error ({exc}): check the password "
                                   "and database number in HSX_REDIS_URL / REDIS_URL") from None
        finally:
            probe.close()


def _process_age_seconds() -> float:
    """Seconds since this process started (Linux /proc; 0 where unknown)."""
    try:
        start_ticks = int(stat_fields("self")[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


def _reason(exc: BaseException) -> str:
    text_ = str(exc).strip() or type(exc).__name__
    return text_.splitlines()[0][:200]


def _server_pid(url: str) -> int | None:
    """The process id of the Redis server answering at ``url``, or None where none answers."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:   # closed: it runs every 50 ms at start
            return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):   # none, or one that will not say (a password)
        return None


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (HSX_REDIS_SERVER may be a wrapper that
    starts redis-server as its child), from /proc; a process that cannot be read counts as unrelated."""
    for _ in range(16):
        if pid == ancestor:
            return True
        try:
            pid = int(stat_fields(pid)[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def start_on_free_ports(start_once, taken, attempts: int = 3):
    """``start_once()``: start a server on ports picked as free, and return it once the process answering there is
    that server. Another process can take a port between the pick and the server's bind: where ``taken(exc)`` says
    so of what ``start_once`` raised, it is called again (it picks again), ``attempts`` times in all."""
    for attempt in range(attempts):
        try:
            return start_once()
        except Exception as exc:
            if not taken(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class PortTaken(RuntimeError):
    """Another process listens on the port a local redis-server was to use."""


def reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_pid(pid: int, sig: int, timeout: float) -> None:
    """Signal ``pid`` (not this process's child: a wrapper's) and wait until it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server (pid {pid}) did not exit within {timeout}s of signal {sig}")
        time.sleep(0.05)


class LocalRedis:
    """A private redis-server on loopback with AOF on, for the embedded default and tests."""

    def __init__(self, data_dir: Path, port: int | None = None, binary: str | None = None):
        self.data_dir = Path(data_dir)
        self.chosen = port is not None   # a port given is kept; one picked here is picked again if it was taken
        self.port = port or free_port()
        self.binary = binary or os.environ.get("HSX_REDIS_SERVER") or shutil.which("redis-server")
        self.proc: subprocess.Popen | None = None
        self.server_pid: int | None = None   # the redis-server that answered as this one's (a wrapper's child)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0, attempts: int = 3, **popen) -> LocalRedis:
        """``popen``: more Popen arguments (hsx_tools.processes.child_options: a session of its own, SIGTERM when
        the parent dies). Started only once the server answering on the port is this process's redis-server: another
        that took a picked port first (between the pick and the bind) is never used; the port is picked again, up to
        ``attempts`` times."""
        if not self.binary:
            raise RuntimeError("redis-server is not installed and no Redis is reachable. Install it "
                               "(apt-get install redis-server) or point HSX_REDIS_URL at a running Redis.")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return start_on_free_ports(lambda: self._start_once(timeout, **popen),
                                   lambda exc: isinstance(exc, PortTaken) and not self.chosen, attempts)

    def _start_once(self, timeout: float, **popen) -> LocalRedis:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction",
             "--save", "", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **popen)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            answering = _server_pid(self.url)
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                if answering is not None:
                    taken = PortTaken(f"redis-server could not listen on port {self.port}: another process (pid "
                                      f"{answering}) answers there")
                    if not self.chosen:
                        self.port = free_port()   # for the next attempt (start_on_free_ports)
                    raise taken
                raise RuntimeError(f"redis-server exited with code {code} on port {self.port}")
            if answering is not None and _descends_from(answering, self.proc.pid):
                self.server_pid = answering
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        """The server stopped (SIGTERM: it writes its AOF and exits; ``kill``: SIGKILL), and where it was started
        through a wrapper script, the redis-server child that answered as this one's too."""
        child = self.server_pid if self.proc is not None and self.server_pid != self.proc.pid else None
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=timeout)
        if child is not None:
            _stop_pid(child, signal.SIGKILL if kill else signal.SIGTERM, timeout)
        self.proc = self.server_pid = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- reading replies (clients here do not decode responses: rq needs bytes) ----
def text(value: bytes | str) -> str:
    """A reply as text. Everything hsx writes is UTF-8; other bytes (planted, or another program's)
    come out with replacement characters instead of failing the read."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def int_hash(r: redis.Redis, key: str) -> dict[str, int]:
    """A HASH of integer counters as {field: int}."""
    return {text(k): int(v) for k, v in r.hgetall(key).items()}


def json_hash(r: redis.Redis, key: str) -> dict[str, object]:
    """A HASH of JSON values as {field: decoded value}."""
    import json

    return {text(k): json.loads(v) for k, v in r.hscan_iter(key, count=1000)}


def zset_members(r: redis.Redis, key: str) -> set[str]:
    return {text(x) for x in r.zrange(key, 0, -1)}
