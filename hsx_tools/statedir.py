"""What `hsx run` and `hsx demo` keep from one call to the next, in one folder (STATE):

    STATE/lock        held by the one command using STATE (a second one is refused, naming the first's pid)
    STATE/redis/      the private redis-server's data (AOF) when no HSX_REDIS_URL is given, and `port`, the
                      port it had (taken again where free, so a URL printed earlier stays right)
    STATE/spool/      the spool's disk tier, unless --spool-dir names another
    STATE/logs/RUN/   one log a child process (produce, worker-*, upload-*), appended call after call

A local store keeps its state with its runs, in STORE/.hsx-state (so the ledger goes where the objects go);
any other store under the user's data folder: $XDG_DATA_HOME/hsx/state/<the store URL as a folder name>
(~/.local/share/hsx/state/... by default).
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

import redis

from hsx.errors import ConfigError
from hsx.redisconn import LocalRedis
from hsx_tools.processes import child_options

LOCAL_STATE = ".hsx-state"   # under a local store's folder


def default_state_dir(store_url: str, endpoint: str | None = None) -> Path:
    if "://" not in store_url or store_url.startswith("file://"):
        return Path(store_url.removeprefix("file://")).expanduser().resolve() / LOCAL_STATE
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{endpoint or ''} {store_url}").strip("_.")
    return base / "hsx" / "state" / name


class StateLock:
    """An exclusive lock on STATE/lock for the life of one command (released by the kernel when it dies)."""

    def __init__(self, state: Path):
        self.path = state / "lock"
        self.fh = None

    def __enter__(self) -> StateLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise ConfigError(f"{self.path.parent} is in use by another hsx command (pid {holder}): wait for it to "
                              f"end, or stop it (Ctrl-C there, or kill {holder}), then run this again") from None
        fh.truncate(0)
        fh.write(str(os.getpid()))
        fh.flush()
        self.fh = fh
        return self

    def __exit__(self, *exc) -> None:
        if self.fh is not None:
            self.fh.close()   # closing releases the lock
            self.fh = None


class RunningRedis:
    """A redis-server of STATE/redis that an earlier call left running (its parent killed where the kernel could
    not stop it with it): used again, and shut down (SHUTDOWN: the AOF is flushed) like one started here."""

    def __init__(self, port: int):
        self.port = port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        try:
            redis.Redis(port=self.port, socket_connect_timeout=2).shutdown()
        except redis.exceptions.RedisError:
            pass


def _serves(port: int, data: Path) -> bool:
    """A Redis answers on loopback ``port`` with ``data`` as its folder."""
    try:
        found = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=2,
                            decode_responses=True).config_get("dir")
    except (redis.exceptions.RedisError, OSError):
        return False
    return bool(found.get("dir")) and Path(found["dir"]).resolve() == data.resolve()


def private_redis(state: Path) -> LocalRedis | RunningRedis:
    """A redis-server (AOF, noeviction) with its data in STATE/redis, on the port it had before where that is
    free, in a session of its own that dies with this process. Hold StateLock(STATE) while it runs."""
    data = (state / "redis").resolve()
    port_file = data / "port"
    port = int(port_file.read_text()) if port_file.exists() else None
    if port and _serves(port, data):
        return RunningRedis(port)
    try:
        local = LocalRedis(data, port=port).start(**child_options())   # None: a free one
    except RuntimeError:
        if port is None:
            raise
        local = LocalRedis(data).start(**child_options())   # the old port is taken: any free one, same data
    port_file.write_text(str(local.port))
    return local
