"""Processes of this host, by pid: whether one still runs, and its /proc fields (Linux)."""

from __future__ import annotations

import os
import socket


def stat_fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (0: state, 1: parent pid, 19: start ticks);
    OSError where the process cannot be read."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def gone(pid: int) -> bool:
    """No such process, or one that exited and waits to be reaped by its parent (a zombie). A process of another
    user is alive (its pid cannot be signalled, but it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return stat_fields(pid)[0] == "Z"
    except (OSError, IndexError):
        return False


def gone_here(host, pid) -> bool:
    """True where (``host``, ``pid``), recorded by a process, names one of this host that no longer runs; a pid
    of another host (or none) says nothing: False. Read from a lock or a temp file's name that such a process
    left behind, so that it can be taken over or removed at once rather than when it ages out."""
    return host == socket.gethostname() and isinstance(pid, int) and gone(pid)


def predecessor_gone(pid) -> bool:
    """True where ``pid``, recorded by an earlier process of this host, names no live process: none such, a
    zombie, no pid at all, or this process's own pid (a container restarted with the same pid)."""
    return not isinstance(pid, int) or pid == os.getpid() or gone(pid)
