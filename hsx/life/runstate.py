"""A run as a whole in Redis: whether it is here, whether it is planned only or still planning, what is left of it.

What the roles and the reader ask of a run, not of one batch: the manifest's presence (a run whose manifest
went with its Redis has vanished), the ``planned_only`` mark of `hsx produce --no-enqueue` (no reconciler
enqueues such a run, hsx/life/reconcile.py), the ``planning`` field of its totals (1 while the producer has
windows left to plan) and, for a follower waiting for the next batch, the planned, done and dead-letter counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from hsx.life import doneledger
from hsx.life.keys import RunKeys
from hsx.redisconn import text


def run_exists(r: redis.Redis, run: str) -> bool:
    """The run's manifest is in this Redis (EXISTS: present is enough, it is not read)."""
    return bool(r.exists(RunKeys(run).manifest))


def planning_in_progress(r: redis.Redis, run: str) -> bool:
    """The producer has windows of the run left to plan (``planning`` of its totals is not 0; none: False)."""
    return bool(int(r.hget(RunKeys(run).totals, "planning") or 0))


def mark_planned_only(r: redis.Redis, run: str, new_run: bool) -> bool:
    """`hsx produce --no-enqueue`: mark a new run (``new_run``), or one still planned only, planned only, before
    any of its plan is in Redis; a run already started stays started. True if the run is planned only."""
    key = RunKeys(run).planned_only
    if new_run or r.exists(key):
        r.set(key, "1")
        return True
    return False


def unmark_planned_only(r: redis.Redis, run: str) -> None:
    """A `hsx produce` that enqueues starts the run: from now on reconcilers enqueue it too."""
    r.delete(RunKeys(run).planned_only)


@dataclass(frozen=True)
class Outstanding:
    """What a run has left: planned batches, how many are done, dead letters not done."""

    batches: int | None     # planned (None: no plan yet)
    done: int
    planning: bool          # the producer is still planning
    dead: list[str]         # dead letters (not done), sorted

    @property
    def complete(self) -> bool:
        return not self.planning and self.batches is not None and self.done == self.batches

    @property
    def only_dead_left(self) -> bool:
        return (bool(self.dead) and not self.planning and self.batches is not None
                and self.done + len(self.dead) == self.batches)


def outstanding(r: redis.Redis, run: str) -> Outstanding:
    """Planned batches, done batches and dead letters not done, now: one MULTI (totals, done count, dead
    letters), and one pipeline of HMGETs when there are dead letters (which of them are done)."""
    keys = RunKeys(run)
    pipe = r.pipeline(transaction=True)
    pipe.hmget(keys.totals, "batches", "planning")
    pipe.hget(keys.counters, "batches")
    pipe.hkeys(keys.dead)
    (total, planning), done, dead = pipe.execute()
    dead = sorted(text(b) for b in dead)
    if dead:
        settled = doneledger.done_among(r, run, dead)
        dead = [b for b in dead if b not in settled]
    return Outstanding(None if total is None else int(total), int(done or 0), bool(planning and int(planning)), dead)
