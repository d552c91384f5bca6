"""Stopping the child processes a tool or test started: SIGTERM to every one still running, then a
wait of ``grace_seconds`` each (a worker finishes the batch in hand), then SIGKILL for any left."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable


def stop_all(procs: Iterable[subprocess.Popen], grace_seconds: float = 30) -> None:
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
