"""What one uploader process holds across its rq jobs: config, Redis, each run's store and limits.

rq calls ``uploader.jobs.upload_batch`` in this same process (SimpleWorker, no
fork); the job finds this object through ``UploaderRuntime.current()``. The
heartbeat refreshes the lease of the upload in progress and keeps every run in
Redis: reclaims work of dead processes, reconciles its queues with its plan and
cleans rq's registry (hsx/fleet/housekeeping.py).
Slot, heartbeat thread, progress log and rq set-up: hsx/fleet/role.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hsx import fleet, life, retry, runspec
from hsx.errors import HsxError
from hsx.fleet import AFTER_RECONCILE, Chores, Role
from hsx.life import RunVanished
from hsx.monitor import fmt_bytes
from hsx.runspec import UploadConfig, open_run_store
from hsx.store import PermanentStoreError, StoreError, layout

log = logging.getLogger(__name__)
REFUSED_PAUSE_SECONDS = 30.0  # s an uploader waits after putting back a job it cannot do (not burst mode)


class UploadsRefused(HsxError):
    """A burst uploader put back jobs it cannot do (spool mismatch, unseen store): exit 2 with the cause."""


class OutsideSpool(HsxError):
    """A job names a file outside this uploader's spool directory; it is neither read nor deleted."""


@dataclass(frozen=True)
class RunContext:
    store: object          # hsx.store.Store of the run (from its manifest)
    ledger: life.Run       # the run's handle, with its limits


class UploaderRuntime(Role):
    noun, command, jobs = "uploader", "hsx upload", (life.UPLOAD_FUNC,)

    def __init__(self, cfg: UploadConfig, r):
        super().__init__(cfg, r)
        self.host = cfg.host
        self.spool_dir = Path(cfg.spool_dir).resolve()
        self.memory_spool_dir = Path(cfg.memory_spool_dir).resolve() if cfg.memory_spool_dir else None
        # the default memory folder (hsx.runspec.spool.default_memory_dir): jobs naming the old shared one are taken too
        self.memory_default = (self.memory_spool_dir is not None
                               and self.memory_spool_dir == runspec.default_memory_dir(cfg.redis_url).resolve())
        self._runs: dict[str, RunContext] = {}
        self._lock = threading.Lock()
        self.in_progress: tuple[str, str] | None = None   # (run, batch id) being uploaded; its lease is refreshed
        self.uploaded = self.bytes = self.failures = 0
        self.refused = 0                                  # jobs put back: this uploader cannot do them (refuse())
        self.refusals: set[str] = set()                   # their causes, each logged once

    # ---- per run -------------------------------------------------------------
    def run_context(self, run: str) -> RunContext:
        """The run's store and handle (its limits), read from its manifest once per process."""
        with self._lock:
            ctx = self._runs.get(run)
        if ctx is None:
            manifest = life.Run(self.r, run).manifest()
            if manifest is None:
                raise RunVanished(f"run {run!r} is no longer in Redis (restarted empty or flushed?)")
            try:
                store = open_run_store(manifest, "uploader", self.host)
            except PermanentStoreError:
                # The store refuses this host for good (403, no such bucket): not a store it cannot see
                # (those jobs are put back for another uploader) but a refusal each upload meets again,
                # counts against its batch and shows on the run with the store's words.
                store = manifest.store.open()
            ctx = RunContext(store, life.Run(self.r, run, manifest.limits))
            with self._lock:
                known = self._runs.setdefault(run, ctx)
            if known is ctx:
                self.say_checks(run, store)
        return ctx

    @staticmethod
    def say_checks(run: str, store) -> None:
        """The start line of a run's store: its endpoint's quirks and the check made of each upload kind
        (hsx/store/quirks.py); a probe that fails now is tried again at the first multipart upload."""
        try:
            line = store.checks_line()
        except PermanentStoreError as exc:   # --s3-integrity crc32 on a server that does not check it
            log.error("run %s: %s", run, exc)
            return
        except StoreError as exc:
            log.warning("run %s: could not probe the store's endpoint (tried again at the first multipart upload): %s",
                        run, exc)
            return
        if line:
            log.info("run %s: %s", run, line)

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
        if tier == runspec.MEMORY_TIER and self.memory_default and resolved == layout.spool_path(
                runspec.LEGACY_MEMORY_DIR, run, batch_id) and not Path(path).is_symlink():
            # A job an older hsx queued for the old shared default: the file is this user's, moved here first.
            runspec.adopt_legacy_spool(run, self.memory_spool_dir, runspec.LEGACY_MEMORY_DIR)
            resolved = expected
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
            self.run_context(run).ledger.clear_refused_uploads(self.host)
        self.after_batch()

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
        life.Run(self.r, run).record_refused_upload(self.host, cause, str(exc))
        if self.cfg.burst:
            self.stop_serving()
        else:
            retry.pause(REFUSED_PAUSE_SECONDS)  # a SIGTERM ends it at once

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1

    # ---- progress log (hsx/fleet/role.py) ------------------------------------------
    def totals(self) -> dict[str, int]:
        return {"batches": self.uploaded, "bytes": self.bytes}

    def progress_line(self) -> str:
        grown, interval = self.since_last_line()
        usage = runspec.spool_usage(self.spool_dir)
        queued = self.queue_length(life.upload_queue_name(self.host))
        return (f"uploader {self.cfg.worker_name}: {self.uploaded} batches, {fmt_bytes(self.bytes)} uploaded; "
                f"last {interval:.0f}s: {60 * grown['batches'] / interval:.1f} batches/min, "
                f"{fmt_bytes(grown['bytes'] / interval)}/s; {self.failures} failed tries"
                + (f", {self.refused} refused ({', '.join(sorted(self.refusals))})" if self.refused else "")
                + f"; spool {usage.files} files "
                f"{fmt_bytes(usage.bytes)}; upload@{self.host} queue {queued}")

    def idle_line(self) -> str | None:
        """Idle once nothing was uploaded since the last line and the queue is empty."""
        if self.queue_length(life.upload_queue_name(self.host)) != "0":
            return None
        return (f"idle: uploader {self.cfg.worker_name} has uploaded {self.uploaded} batches ({fmt_bytes(self.bytes)}); "
                f"upload@{self.host} is empty, waiting for jobs")

    # ---- serving (hsx/fleet/role.py) -----------------------------------------------
    def queue_names(self) -> list[str]:
        return [life.upload_queue_name(self.host)]

    def prepare(self) -> None:
        self.abort_stale_multipart()

    def say_ready(self) -> None:
        log.info("ready: uploader %s taking jobs from upload@%s, spool %s", self.cfg.worker_name, self.host, self.spool_dir)

    def close(self) -> None:
        """The role's close, then the memory tier's empty run folders go, and the default folder itself once empty
        (hsx/runspec/spool.py ``remove_empty_spool_folders``): a clean stop leaves nothing in /dev/shm."""
        super().close()
        if self.memory_spool_dir is not None:
            runspec.remove_empty_spool_folders(self.memory_spool_dir, itself=self.memory_default)

    def abort_stale_multipart(self) -> None:
        """Abort each run's multipart uploads that uploaders killed mid-upload left (hsx/fleet/multipart.py says which
        are safe to abort: never a live one of another uploader). A store that cannot be reached is no reason
        not to start: the next start or `hsx verify --repair` tries again."""
        for run in life.Run.names(self.r):
            try:
                ctx = self.run_context(run)
                aborted = fleet.abort_stale_uploads(self.r, ctx.store, run, ctx.ledger.limits.lease_seconds)
            except Exception as exc:
                log.warning("run %s: could not check for stale multipart uploads: %s", run, exc)
                continue
            if aborted:
                log.warning("run %s: aborted %d incomplete multipart uploads left by killed uploaders: %s", run,
                            len(aborted), ", ".join(u.key for u in aborted[:5]))

    # ---- heartbeat -----------------------------------------------------------
    def refresh(self) -> None:
        """The lease of the upload in progress."""
        job = self.in_progress
        if job:
            run, bid = job
            self.run_context(run).ledger.refresh_upload_leases([bid])

    def kept_runs(self) -> Iterator[Chores]:
        """Every run in Redis with a manifest, each read just before its housekeeping; rq's registry is cleaned
        at every beat, after the reconcile pass."""
        for run in life.Run.names(self.r):
            manifest = life.Run(self.r, run).manifest()
            if manifest is not None:
                yield Chores(life.Run(self.r, run, manifest.limits), clean_rq=AFTER_RECONCILE)
