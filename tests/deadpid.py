"""A pid of this host that names no live process: a writer or a producer killed before it could tidy up."""

from __future__ import annotations

import subprocess
import sys

from hsx.pids import gone


def a_dead_pid() -> int:
    """The pid of a child that ran and was reaped (nothing reuses it within a test: Linux hands pids out in turn)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert proc.wait() == 0
    assert gone(proc.pid), proc.pid
    return proc.pid
