"""A role restarted under a fixed ``--name`` takes the name back from its dead predecessor (hsx/fleet/role.py).

rq refuses to start a worker whose name is registered without a death mark
("There exists an active worker named ... already"), and a SIGKILLed worker
leaves that registration for up to job timeout + 60 s (~61 min by default).
hsx knows better whether the predecessor lives: its heartbeat (pid and host
inside, TTL a few beats). The name is taken over when that heartbeat is gone,
or names this host and a pid that no longer runs (or our own pid: a container
restarted with the same pid); a heartbeat of another live process is waited
for up to its TTL, then the start is refused.
"""

from __future__ import annotations

import json
import logging
import time

from hsx import life
from hsx.errors import HsxError
from hsx.life import RunKeys
from hsx.pids import predecessor_gone

log = logging.getLogger(__name__)


class NameTaken(HsxError, RuntimeError):
    """Another live worker holds this --name."""


def predecessor_dead(r, run: str, name: str, host: str) -> bool:
    raw = r.get(RunKeys(run).heartbeat(name))
    if raw is None:
        return True
    stats = json.loads(raw)
    return stats.get("host") == host and predecessor_gone(stats.get("pid"))


def claim_name(r, rq_worker, run: str, host: str, heartbeat_seconds: float) -> bool:
    """Clear a dead predecessor's rq registration of ``rq_worker.name``; True if one was cleared."""
    if not r.exists(rq_worker.key) or r.hexists(rq_worker.key, "death"):
        return False
    deadline = time.monotonic() + life.ttl_seconds(heartbeat_seconds) + 1
    while not predecessor_dead(r, run, rq_worker.name, host):
        if time.monotonic() >= deadline:
            raise NameTaken(f"a live worker named {rq_worker.name!r} heartbeats for run {run!r} (another process or "
                            "host): give this worker another --name")
        time.sleep(0.5)
    rq_worker.register_death()  # rq's own way: unregistered, marked dead, so register_birth accepts the name
    log.warning("worker name %s was still registered by a dead process (killed?); took it over", rq_worker.name)
    return True
