"""The child processes a tool or test starts: `hsx <role>` commands, each in its own session and stopped in order.

A child started through ``Children`` (or with ``child_options()``) is in a session of its own, so a Ctrl-C at
the terminal reaches only the parent, which then stops its children itself (SIGTERM, a grace, SIGKILL), and
it gets SIGTERM from the kernel when its parent dies, whatever killed the parent (Linux's PR_SET_PDEATHSIG):
no role outlives the command that started it. ``stop_all``: SIGTERM to every one still running, then up to
``grace_seconds`` for them all (a worker finishes the batch in hand), then SIGKILL for any left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

PR_SET_PDEATHSIG = 1   # linux/prctl.h


def hsx_argv(*args: str) -> list[str]:
    """``hsx ARGS...`` with this interpreter (the checkout or install this process runs from)."""
    return [sys.executable, "-m", "hsx_cli.main", *args]


def child_options() -> dict:
    """Popen keyword arguments: a session of its own, and SIGTERM when this process dies (where Linux offers it)."""
    try:
        import ctypes
        import ctypes.util

        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return {"start_new_session": True}
    parent = os.getpid()

    def die_with_parent() -> None:   # runs in the child between fork and exec: nothing here may import
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:   # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return {"start_new_session": True, "preexec_fn": die_with_parent}


def stop_all(procs: Iterable[subprocess.Popen], grace_seconds: float = 30) -> None:
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Children:
    """`hsx` commands started as children, by name, each writing stdout and stderr to LOGS/<name>.log."""

    def __init__(self, logs: Path, env: dict):
        self.logs, self.env = logs, env
        self.procs: dict[str, subprocess.Popen] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.log_path(name), "a") as log:   # appended: a resumed run keeps the earlier calls' lines
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} hsx {' '.join(args)}\n")
            log.flush()
            proc = subprocess.Popen(hsx_argv(*args), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, **child_options())
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def exited(self) -> dict[str, int]:
        """{name: exit status} of the children that have exited."""
        return {name: proc.returncode for name, proc in self.procs.items() if proc.poll() is not None}

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def stop(self, grace_seconds: float) -> None:
        stop_all(self.procs.values(), grace_seconds)
