"""A role's housekeeping of the runs it keeps, made from its heartbeat (rq's ``Worker.run_maintenance_tasks``).

What dead processes left is taken back by whoever is alive. ``Role.beat()`` refreshes what this process holds
(``refresh()``: heartbeat, leases), then makes one ``keep_run`` call for each ``Chores`` its ``kept_runs()``
hook yields (a GPU worker: its own run; an uploader: every run with a manifest). A call, in this order:

    Redis settling   down, or back for less than a lease (hsx.redisconn.OUTAGES): nothing at all. Every lease
                     and heartbeat looks expired then; live owners refresh theirs first
    reap             expired extract / upload leases: their batches back to the queue front (hsx.life.Run.reap)
    tidy             the role's own leftovers of dead processes (a GPU worker: dead writers' temp files)
    rq clean-up      if BEFORE_RECONCILE: rq's registry of workers with no hsx heartbeat (``Run.forget_dead_workers``)
    reconcile        the queues against the plan, one pass per lease / 2 of all processes (hsx.life.Run.maybe_reconcile)
    rq clean-up      if AFTER_RECONCILE

The cadences are the role's, in the chores it yields: a GPU worker tidies and cleans rq's registry every
HEARTBEATS_PER_SWEEP-th beat (one heartbeat TTL), before the pass; an uploader cleans it at every beat, for
every run, after the pass. (The two places are as the roles had them; one order is a later, behavioural step.)
Housekeeping at start stays in the role's ``prepare()``: the name claim, a worker's spool recovery, an
uploader's abort of multipart uploads killed uploaders left (it needs the run's store).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hsx import life
from hsx.redisconn import OUTAGES

BEFORE_RECONCILE = "before reconcile"  # Chores.clean_rq: where in the call rq's registry is cleaned
AFTER_RECONCILE = "after reconcile"


@dataclass(frozen=True)
class Chores:
    """One run's housekeeping at one beat."""
    run: life.Run                              # the run's handle, with its limits (lease length, max attempts)
    clean_rq: str | None = None                # BEFORE_RECONCILE, AFTER_RECONCILE, or None: not at this beat
    tidy: Callable[[], object] | None = None   # the role's own sweep, after the reap; None: none at this beat

    def __post_init__(self):
        if self.clean_rq not in (None, BEFORE_RECONCILE, AFTER_RECONCILE):
            raise ValueError(f"clean_rq must be {BEFORE_RECONCILE!r}, {AFTER_RECONCILE!r} or None, not {self.clean_rq!r}")


def keep_run(redis_url: str, chores: Chores) -> bool:
    """Reap, tidy, clean rq's registry and reconcile ``chores.run`` (the module's docstring); False when Redis at
    ``redis_url`` is settling after an outage and nothing was done."""
    run = chores.run
    if OUTAGES.settling(redis_url, run.limits.lease_seconds):
        return False
    run.reap()
    if chores.tidy is not None:
        chores.tidy()
    if chores.clean_rq == BEFORE_RECONCILE:
        run.forget_dead_workers()
    run.maybe_reconcile()
    if chores.clean_rq == AFTER_RECONCILE:
        run.forget_dead_workers()
    return True
