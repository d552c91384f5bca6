"""Which process listens on a loopback TCP port, from /proc (Linux): so a test server started on a port picked as
free is known to be the one answering there, not another server that took the port between the pick and the bind
(two test processes at once, or anything else on the host, pick from the same ports)."""

from __future__ import annotations

import os

LISTEN = "0A"   # the TCP state column of /proc/net/tcp


def listener_inodes(port: int) -> set[str]:
    """Socket inodes listening on ``port`` (any local address), from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found


def listens(pid: int, port: int) -> bool:
    """True once process ``pid`` holds a socket listening on ``port``."""
    inodes = listener_inodes(port)
    if not inodes:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def address_in_use(exc: BaseException) -> bool:
    """For hsx.redisconn.start_on_free_ports: a server process that exited because its port was taken."""
    return isinstance(exc, RuntimeError) and "address already in use" in str(exc)
