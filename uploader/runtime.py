"""What one uploader process holds across its rq jobs: config, Redis, each run's store and limits.

rq calls ``uploader.jobs.upload_batch`` in this same process (SimpleWorker, no
fork); the job finds this object through ``current()``, as the GPU worker's
jobs find ``gpu_worker.runtime``. The heartbeat thread refreshes the lease of
the upload in progress, reclaims work of dead processes, reconciles each run's
queues with its plan (hsx/run/reconcile.py), and logs progress.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hsx import spool
from hsx.config import UploadConfig
from hsx.defaults import DEFAULT_LOG_EVERY_BATCHES
from hsx.errors import HsxError
from hsx.manifest import RunLimits
from hsx.redisconn import OUTAGES
from hsx.run import batchlife, leases, ledger, reconcile, refused, rqclean
from hsx.run.keys import RunKeys
from hsx.run.ledger import RunVanished
from hsx.run.progress import fmt_bytes
from hsx.store import PermanentStoreError, layout
from hsx.visibility import open_run_store

log = logging.getLogger(__name__)
REFUSED_PAUSE_SECONDS = 30.0  # s an uploader waits after putting back a job it cannot do (not burst mode)
_current: UploaderRuntime | None = None


class UploadsRefused(HsxError):
    """A burst uploader put back jobs it cannot do (spool mismatch, unseen store): exit 2 with the cause."""


class OutsideSpool(HsxError):
    """A job names a file outside this uploader's spool directory; it is neither read nor deleted."""


def current() -> UploaderRuntime:
    if _current is None:
        raise RuntimeError("upload jobs run only inside `hsx upload` (no uploader runtime in this process)")
    return _current


def install(runtime: UploaderRuntime | None) -> None:
    global _current
    _current = runtime


@dataclass(frozen=True)
class RunContext:
    store: object          # hsx.store.Store of the run (from its manifest)
    limits: RunLimits


class UploaderRuntime:
    def __init__(self, cfg: UploadConfig, r):
        self.cfg, self.r = cfg, r
        self.host = cfg.host
        self.spool_dir = Path(cfg.spool_dir).resolve()
        self.memory_spool_dir = Path(cfg.memory_spool_dir).resolve() if cfg.memory_spool_dir else None
        self._runs: dict[str, RunContext] = {}
        self._lock = threading.Lock()
        self.in_progress: tuple[str, str] | None = None   # (run, batch id) being uploaded; its lease is refreshed
        self.uploaded = self.bytes = self.failures = 0
        self.refused = 0                                  # jobs put back: this uploader cannot do them (refuse())
        self.refusals: set[str] = set()                   # their causes, each logged once
        self.on_refused = None                            # set by the worker loop in burst mode: how to stop it
        self.started = time.monotonic()
        self._logged_at, self._logged_batches, self._logged_bytes, self._said_idle = self.started, 0, 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="hsx-upload-heartbeat", daemon=True)

    # ---- per run -------------------------------------------------------------
    def run_context(self, run: str) -> RunContext:
        """The run's store and limits, read from its manifest once per process."""
        with self._lock:
            ctx = self._runs.get(run)
        if ctx is None:
            manifest = ledger.get_manifest(self.r, run)
            if manifest is None:
                raise RunVanished(f"run {run!r} is no longer in Redis (restarted empty or flushed?)")
            try:
                store = open_run_store(manifest, "uploader", self.host)
            except PermanentStoreError:
                # The store refuses this host for good (403, no such bucket): not a store it cannot see
                # (those jobs are put back for another uploader) but a refusal each upload meets again,
                # counts against its batch and shows on the run with the store's words (issue 23 item 4).
                store = manifest.store.open()
            ctx = RunContext(store, manifest.limits)
            with self._lock:
                self._runs.setdefault(run, ctx)
        return ctx

    def spool_file(self, run: str, batch_id: str, path: str, tier: str = "disk") -> Path:
        """The spool file of (run, batch) in ``tier``, if ``path`` names exactly it; else OutsideSpool.

        ``path`` comes from Redis: it must resolve (symlinks, ``..``) to this uploader's own
        ``<tier's spool dir>/<run>/<batch>.safetensors`` (tier disk: --spool-dir, memory:
        --memory-spool-dir), and no symlink may lie on the way to that file, so a forged job can
        neither read nor delete any other file (another batch's included).
        """
        roots = {"disk": self.spool_dir, "memory": self.memory_spool_dir}
        if roots.get(tier) is None:
            raise OutsideSpool(f"upload job of {run}/{batch_id} names spool tier {tier!r}, which this uploader does not "
                               "serve (set --memory-spool-dir to the workers' memory tier); refused, nothing read or deleted")
        expected = layout.spool_path(roots[tier], run, batch_id)
        resolved = Path(path).resolve()
        if resolved != expected:
            raise OutsideSpool(f"upload job of {run}/{batch_id} names {path}, not its spool file {expected} "
                               f"(--spool-dir / HSX_SPOOL_DIR must be the spool of the workers of host {self.host}); "
                               "refused, nothing read or deleted")
        if expected.resolve() != expected:
            raise OutsideSpool(f"spool file {expected} of {run}/{batch_id} is reached through a symlink; refused, "
                               "nothing read or deleted")
        return expected

    # ---- accounting ----------------------------------------------------------
    def record_upload(self, size: int, run: str | None = None) -> None:
        with self._lock:
            self.uploaded += 1
            self.bytes += size
        if run is not None:  # this host uploads again: a refusal recorded by a misconfigured uploader is over
            refused.clear(self.r, run, self.host)
        if self.uploaded - self._logged_batches >= DEFAULT_LOG_EVERY_BATCHES:
            self.log_progress()

    def refuse(self, run: str, exc: Exception) -> None:
        """A job this uploader cannot do (spool mismatch, unseen store): counted, logged once with the fix,
        recorded for `hsx status`; then a pause (burst mode: stop), so the job is not taken back at once."""
        cause = "spool mismatch" if isinstance(exc, OutsideSpool) else "store not visible"
        with self._lock:
            self.refused += 1
            first = cause not in self.refusals
            self.refusals.add(cause)
        if first:
            log.error("uploads refused: %s on host %s: %s. This uploader puts such jobs back and %s", cause, self.host,
                      exc, "stops (burst mode)" if self.cfg.burst else f"waits {REFUSED_PAUSE_SECONDS:.0f} s between tries")
        refused.record(self.r, run, self.host, cause, str(exc))
        if self.cfg.burst:
            if self.on_refused is not None:
                self.on_refused()
        else:
            self._stop.wait(REFUSED_PAUSE_SECONDS)

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1

    def progress_line(self) -> str:
        interval = max(time.monotonic() - self._logged_at, 1e-9)  # rates over the last interval, not a lifetime
        usage = spool.usage(self.spool_dir)
        queued = self.queued()
        return (f"uploader {self.cfg.worker_name}: {self.uploaded} batches, {fmt_bytes(self.bytes)} uploaded; "
                f"last {interval:.0f}s: {60 * (self.uploaded - self._logged_batches) / interval:.1f} batches/min, "
                f"{fmt_bytes((self.bytes - self._logged_bytes) / interval)}/s; {self.failures} failed tries"
                + (f", {self.refused} refused ({', '.join(sorted(self.refusals))})" if self.refused else "")
                + f"; spool {usage.files} files "
                f"{fmt_bytes(usage.bytes)}; upload@{self.host} queue {queued}")

    def queued(self) -> int:
        from hsx.run import queues

        return queues.queue(self.r, queues.upload_queue_name(self.host)).count

    def log_progress(self, final: bool = False) -> None:
        """A progress line; once idle (nothing uploaded since the last line, queue empty) one idle line, then
        silence until work comes. ``final``: the summary on exit, always written."""
        try:
            idle = not final and self.uploaded == self._logged_batches and self.queued() == 0
            line = None if idle else self.progress_line()
        except Exception as exc:  # Redis away: the next beat tries again
            idle, line = False, f"uploader {self.cfg.worker_name}: {self.uploaded} batches uploaded (queue unknown: {exc})"
        if idle:
            if not self._said_idle:
                log.info("idle: uploader %s has uploaded %d batches (%s); upload@%s is empty, waiting for jobs",
                         self.cfg.worker_name, self.uploaded, fmt_bytes(self.bytes), self.host)
            self._said_idle, self._logged_at = True, time.monotonic()
            return
        self._said_idle = False
        self._logged_at, self._logged_batches, self._logged_bytes = time.monotonic(), self.uploaded, self.bytes
        log.info("%s", line)

    # ---- heartbeat -----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def beat(self) -> None:
        job = self.in_progress
        if job:
            run, bid = job
            leases.refresh(self.r, RunKeys(run).upload_leases, [bid], self.run_context(run).limits.lease_seconds)
        for run in ledger.list_runs(self.r):
            manifest = ledger.get_manifest(self.r, run)
            if manifest is not None:
                limits = manifest.limits
                if OUTAGES.settling(self.cfg.redis_url, limits.lease_seconds):
                    continue  # just back from a Redis outage: live owners refresh their leases first
                batchlife.reap(self.r, run, limits.max_attempts)
                reconcile.maybe_reconcile(self.r, run, limits.lease_seconds / 2)
                rqclean.forget_dead_workers(self.r, run)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_seconds):
            try:
                self.beat()
            except Exception as exc:  # Redis away: the job itself will notice; try again next beat
                log.warning("uploader heartbeat failed: %s", exc)
            if time.monotonic() - self._logged_at >= self.cfg.log_every_seconds:
                self.log_progress()
