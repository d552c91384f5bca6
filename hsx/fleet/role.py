"""The skeleton every long-running role shares: runtime slot, heartbeat, progress log, rq worker, stop.

A role is one folder (``gpu_worker/``, ``uploader/``): a ``Role`` subclass holding what its process
keeps across jobs, the rq job functions (plain functions; each finds its process's runtime through
``TheRole.current()``), and a ``hsx_cli`` sub-command that builds the runtime and calls ``serve()``.

    serve():  rq worker (hsx/fleet/rqworker.py) on queue_names(), JSON only, job_class running only this role's `jobs`
              -> claim the --name from a dead predecessor (roles with a run: hsx/fleet/nameclaim.py)
              -> prepare() -> install in the slot -> start(): heartbeat thread -> say_ready()
              -> rq's work loop (SimpleWorker: jobs run in this process, no fork)
              -> close(): heartbeat stops, heartbeat key deleted -> slot emptied -> summary line

Heartbeat thread: ``beat()`` every ``heartbeat_seconds`` (a failing beat is logged and tried again
next time: Redis may be away), and a progress line at least every ``log_every_seconds``. A beat is
``refresh()`` (what this process holds: heartbeat, leases), then the housekeeping of each run the role
keeps (``kept_runs()``: reap, reconcile, rq's registry; hsx/fleet/housekeeping.py). Each beat also
reads Redis' maxmemory-policy (hsx/fleet/evictionpolicy.py): set to an evicting one while the role runs,
the role says so and stops taking jobs (the job in hand finishes), and ``serve()`` raises the refusal.

Progress log: ``progress_line()`` over the counters of ``totals()`` ("batches" is required): a line
every DEFAULT_LOG_EVERY_BATCHES batches (``after_batch()``) or interval, rates over the interval since
the last line; while nothing was done, ``idle_line()`` (if any) is said once instead, then silence.

Signals: rq's work loop owns SIGTERM and SIGINT (the first: warm shutdown, the job in hand finishes;
the second: cold). ``stop_serving()`` is the same stop from any thread (the heartbeat's, a job's).
Once rq's loop is over (its teardown, the role's close()), a first stop request is no StopRequested error but the
same warm stop (hsx/fleet/rqworker.py).
rq never gives the handlers back: ``serve()`` puts back those it found once the role is closed (a signal
during close() meets rq's, as before), so a role served in-process (tests, bench) leaves its host's
SIGTERM its own (pytest turned `timeout`'s SIGTERM into an rq StopRequested inside a
later test). Only in the main thread, the one where Python sets handlers.
A stop request also sets hsx.retry.STOP: every back-off and pause of the job in hand ends at once
(``hsx.retry.pause``), and so does a wait for Redis (hsx/redisconn.py), so the warm shutdown waits for work,
never for a timer or for Redis: a stop while Redis is away (or full) ends without it, in one line, exit 0 (a
batch in hand comes back through its lease). The bound a role states (docs/deploy.md, "Stopping") is held by
the role itself past that: hsx/fleet/stopping.py.

The config a role passes in (one frozen object per role, hsx/runspec/config.py) has at least ``worker_name``,
``host``, ``burst``, ``heartbeat_seconds`` and ``log_every_seconds``; a role that keeps runs, ``redis_url`` too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from functools import cached_property

from hsx import life, retry
from hsx.defaults import DEFAULT_GRACE_SECONDS, DEFAULT_LOG_EVERY_BATCHES, STOP_DEADLINE_MARGIN_SECONDS
from hsx.errors import HsxError
from hsx.fleet.evictionpolicy import EvictingRedis, check_eviction_policy
from hsx.fleet.housekeeping import Chores, keep_run
from hsx.fleet.nameclaim import claim_name
from hsx.fleet.rqworker import RqWorker, StopRequested
from hsx.fleet.stopping import QUIET_RQ, StopDeadline, stopped_without_redis

log = logging.getLogger(__name__)
def _signal_handlers() -> dict[int, object] | None:
    """This process's SIGINT/SIGTERM handlers, to put back after rq's work loop (which installs its own and
    never restores them); None outside the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict[int, object] | None) -> None:
    for signum, handler in (handlers or {}).items():
        if handler is not None:  # None: a handler set outside Python, which cannot be set again from here
            signal.signal(signum, handler)


class Role:
    noun = "role"                  # the role in log lines and messages: "worker", "uploader"
    command = "hsx"                # the command that runs it, for the message of a job run elsewhere
    jobs: tuple[str, ...] = ()     # "module.function" of each rq job this role runs; its worker runs no other
    run: str | None = None         # the run it serves; None: every run (no heartbeat, no name claim)
    _installed: Role | None = None

    def __init__(self, cfg, r):
        self.cfg, self.r, self.name = cfg, r, cfg.worker_name
        self.started = time.time()
        self._logged_at, self._logged, self._said_idle = time.monotonic(), {}, False  # _logged: totals at the last line
        self._stop = threading.Event()
        self.refusal: HsxError | None = None   # why the role stopped taking jobs by itself, raised by serve()
        self._finishing = False  # finished() said yes once: serving is being stopped
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"hsx-{self.noun}-heartbeat", daemon=True)
        self._rq_worker: RqWorker | None = None
        self.left_redis = False  # stopped without Redis: said once (hsx/fleet/stopping.py)

    # ---- the slot: rq jobs find their process's runtime here ----------------------
    @classmethod
    def current(cls) -> Role:
        if cls._installed is None:
            raise RuntimeError(f"{cls.noun} jobs run only inside `{cls.command}` (no {cls.noun} runtime in this process)")
        return cls._installed

    @classmethod
    def installed(cls) -> Role | None:
        return cls._installed

    @classmethod
    def install(cls, runtime: Role | None) -> None:
        cls._installed = runtime

    @cached_property
    def ledger(self) -> life.Run:
        """The handle on the run this role serves (a role of every run has none)."""
        if self.run is None:
            raise RuntimeError(f"this {self.noun} serves every run: name one (life.Run(r, run))")
        return life.Run(self.r, self.run)

    # ---- what a role fills in -------------------------------------------------------
    def queue_names(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """Before the first beat and job (after the name claim): recover what a predecessor left."""

    def say_ready(self) -> None:
        log.info("ready: %s %s taking jobs from %s", self.noun, self.name, ", ".join(self.queue_names()))

    def totals(self) -> dict[str, int]:
        """The counters the progress line shows; "batches" (batches finished) is the one every role has."""
        return {"batches": 0}

    def stats(self) -> dict:
        """The heartbeat record (hsx.life.records.HEARTBEAT): `hsx status` and the dashboard list it."""
        return {"host": self.cfg.host, "pid": os.getpid(), **self.totals()}

    def refresh(self) -> None:
        """A beat's own part: what this process holds kept alive; by default its stats under its run."""
        if self.run is not None:
            self.publish_heartbeat(self.stats())

    def kept_runs(self) -> Iterable[Chores]:
        """The runs whose housekeeping this process does at this beat, each with its chores (which, how often:
        hsx/fleet/housekeeping.py); by default none. Iterated as the beat goes, so a generator's reads of a run
        come just before that run's housekeeping."""
        return ()

    def progress_line(self) -> str:
        grown, seconds = self.since_last_line()
        return (f"{self.noun} {self.name}: {self.totals()['batches']} batches; last {seconds:.0f}s: "
                f"{60 * grown['batches'] / seconds:.1f} batches/min; "
                + "; ".join(f"{name} queue {self.queue_length(name)}" for name in self.queue_names()))

    def finished(self) -> bool:
        """Whether this role has nothing more to do and asked to exit then (e.g. --exit-when-complete); checked
        at every heartbeat, a True stops serving as SIGTERM would."""
        return False

    def idle_line(self) -> str | None:
        """Called while no batch finished since the last line: a line saying why this role is idle (logged
        once, then silence until work comes), or None for the progress line as usual."""
        return None

    # ---- heartbeat ----------------------------------------------------------------------
    def beat(self) -> None:
        """One heartbeat: ``refresh()``, then ``housekeep()`` (a refresh that fails skips it)."""
        self.refresh()
        self.housekeep()

    def housekeep(self) -> None:
        """One ``keep_run`` call for each run ``kept_runs()`` yields (rq's ``run_maintenance_tasks``, for hsx)."""
        for chores in self.kept_runs():
            keep_run(self.cfg.redis_url, chores)

    def publish_heartbeat(self, stats: dict, pipe=None) -> None:
        self.ledger.publish_heartbeat(self.name, stats, life.ttl_seconds(self.cfg.heartbeat_seconds), pipe=pipe)

    def start(self) -> None:
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def close(self) -> None:
        """Stop beating and say goodbye: the heartbeat goes and the last record holds the final totals and the
        stop (state "stopped", hsx/life/heartbeat.py): it is gone, not dead."""
        self.stop_heartbeat()
        if self.run is not None:
            try:
                stats = self.stats()
            except Exception as exc:  # e.g. a device probe that fails now: the counts still go, the stop is clean
                log.warning("%s %s: final stats incomplete (%s: %s)", self.noun, self.name, type(exc).__name__, exc)
                stats = Role.stats(self)
            self.ledger.publish_stopped(self.name, stats)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_seconds):
            try:
                self.check_redis_policy()
                self.beat()
            except EvictingRedis as exc:
                if self.refusal is None:
                    log.error("%s; %s %s stops taking jobs (the job in hand finishes)", exc, self.noun, self.name)
                self.refuse(exc)
            except Exception as exc:  # Redis away: keep working, beat again later (stopping without it: said once)
                if not (retry.STOP.is_set() and QUIET_RQ.away(exc)):
                    log.warning("%s heartbeat failed: %s", self.noun, exc)
            if time.monotonic() - self._logged_at >= self.cfg.log_every_seconds:
                self.log_progress()
            if not self._finishing:
                try:
                    self._finishing = self.finished()
                except Exception:  # Redis away: not finished as far as this beat knows
                    pass
                if self._finishing:  # beats go on (leases of a job in hand) until serve() returns
                    self.stop_serving()

    def check_redis_policy(self) -> None:
        """EvictingRedis when Redis now runs with a policy that may evict the run's keys (set while running:
        checked every beat, before memory pressure evicts anything)."""
        check_eviction_policy(self.r, "Redis")

    # ---- progress log -----------------------------------------------------------------
    def since_last_line(self) -> tuple[dict[str, int], float]:
        """Each total's growth since the last progress line, and the seconds since it (rates over an interval:
        a lifetime average hides a role gone idle)."""
        grown = {name: value - self._logged.get(name, 0) for name, value in self.totals().items()}
        return grown, max(time.monotonic() - self._logged_at, 1e-9)

    def queue_length(self, queue_name: str) -> str:
        try:
            return str(life.queue(self.r, queue_name).count)
        except Exception as exc:  # Redis away
            return f"unknown ({type(exc).__name__})"

    def after_batch(self) -> None:
        """A batch finished: a progress line once DEFAULT_LOG_EVERY_BATCHES finished since the last one."""
        if self.totals()["batches"] - self._logged.get("batches", 0) >= DEFAULT_LOG_EVERY_BATCHES:
            self.log_progress()

    def log_progress(self, final: bool = False) -> None:
        """A progress line, or while idle the idle line once. ``final``: the summary on exit, always written."""
        totals = self.totals()
        if not final and totals["batches"] == self._logged.get("batches", 0):
            idle = self.idle_line()
            if idle is not None:
                if not self._said_idle:
                    log.info("%s", idle)
                self._said_idle, self._logged_at = True, time.monotonic()
                return
        line = self.progress_line()
        self._said_idle, self._logged_at, self._logged = False, time.monotonic(), totals
        log.info("%s", line)

    # ---- serving ----------------------------------------------------------------------
    def serve(self, worker_class: type[RqWorker] = RqWorker, exception_handlers: tuple = ()) -> None:
        """Take jobs until stopped (SIGTERM, SIGINT, ``stop_serving``) or, with ``burst``, until the queues are empty."""
        life.rq_without_pickle()  # a role's entry: rq's default serializer reads JSON only from here on (rule 5)
        worker = worker_class(self.queue_names(), connection=self.r, name=self.name, job_class=life.job_class(self.jobs),
                              exception_handlers=list(exception_handlers), on_stop_request=retry.STOP.set)
        if self.run is not None:  # before prepare(): a role may sweep what its name's predecessor left
            claim_name(self.r, worker, self.run, self.cfg.host, self.cfg.heartbeat_seconds)
        retry.STOP.clear()
        self.prepare()
        self._rq_worker = worker
        type(self).install(self)
        self.start()
        self.say_ready()
        handlers = _signal_handlers()
        logging.getLogger("rq.worker").addFilter(QUIET_RQ)  # one object: added once however often roles serve
        deadline = StopDeadline(f"{self.noun} {self.name}", self.stop_deadline_seconds()).arm()
        try:
            with stopped_without_redis(self):
                try:
                    worker.work(burst=self.cfg.burst, logging_level="WARNING")
                except StopRequested:  # a stop between rq's loop and its teardown: the stop it asked for
                    pass
        finally:
            try:
                with stopped_without_redis(self):
                    self.close()
                type(self).install(None)
                self._rq_worker = None
                self.log_progress(final=True)
            finally:  # last: while close() drains, a signal (or stop_serving's) still meets rq's handlers
                deadline.disarm()
                _restore(handlers)
        if self.refusal is not None:
            raise self.refusal

    def stop_deadline_seconds(self) -> float:
        """Seconds after a stop request past which this process exits anyway (hsx/fleet/stopping.py): its
        grace (a worker's --grace-seconds; the default for others) and a margin for the work in hand and the exit."""
        return getattr(self.cfg, "grace_seconds", DEFAULT_GRACE_SECONDS) + STOP_DEADLINE_MARGIN_SECONDS

    def refuse(self, why: HsxError) -> None:
        """Stop taking jobs by itself (the job in hand finishes): ``serve()`` raises ``why``; the first one wins."""
        if self.refusal is None:
            self.refusal = why
            self.stop_serving()

    def stop_serving(self) -> None:
        """Stop taking jobs, from any thread: the warm shutdown of SIGTERM (`docker compose stop`)."""
        worker = self._rq_worker
        if worker is None:
            return
        retry.STOP.set()
        worker.stop_taking_jobs()
        if not self.cfg.burst:
            os.kill(os.getpid(), signal.SIGTERM)  # rq's handler interrupts a blocking dequeue
