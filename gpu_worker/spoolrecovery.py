"""A worker's spool after a restart: dead writers' temp files swept, complete files' uploads queued again.

The spool may be shared with other live workers of this host: a temp file whose writer still heartbeats is a
write in progress and stays (until a later sweep finds it dead). The worker recovers once before it takes a
job (``WorkerRuntime.prepare``) and sweeps again every few heartbeats (its housekeeping's ``tidy``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from hsx import life, runspec
from hsx.batch import BatchFileError
from hsx.digest import file_sha256
from hsx.runspec import SpoolTiers, WorkerConfig

log = logging.getLogger(__name__)


class SpoolRecovery:
    """The spool folders of one worker (``tiers``: its ``cfg.tiers``) for its run, against the run's ``ledger``."""

    def __init__(self, ledger: life.Run, cfg: WorkerConfig, tiers: SpoolTiers):
        self.ledger, self.cfg, self.tiers = ledger, cfg, tiers
        self.run, self.worker_name = cfg.run, cfg.worker_name

    def sweep_temp_files(self, at_start: bool = False) -> int:
        """Remove temp files of writers with no live heartbeat, in every tier; the number removed.

        Runs at start and on every HEARTBEATS_PER_SWEEP-th beat: a writer that died within its heartbeat TTL of
        this worker's start still looked alive then. At start, temp files under this worker's own name are a
        killed predecessor's of the same ``--name`` (this process has written nothing yet) and go too.
        """
        removed = 0
        for tier in self.tiers.tiers:
            for tmp, writer in runspec.spool_temp_files(tier.dir, self.run).items():
                if writer == self.worker_name:
                    if not at_start:
                        continue
                elif self.ledger.worker_alive(writer):
                    continue
                log.info("removing unfinished temp file %s (its writer %s has no heartbeat)", tmp, writer)
                tmp.unlink(missing_ok=True)
                removed += 1
        return removed

    def recover(self) -> int:
        """After a restart: drop dead writers' temp files, re-enqueue uploads of complete files not yet done;
        the number re-enqueued.

        Only a file that proves it is of this plan is re-enqueued (hsx/life/provenance.py): one of another
        incarnation of the run (it was reset since) or with other samples is removed, its batch is extracted
        again; one whose batch is not planned (yet: a plan being written again) or whose header cannot be read
        is left alone, not enqueued (a re-extraction overwrites it).
        """
        self.sweep_temp_files(at_start=True)
        adopted = self.adopt_legacy()
        pending = self.ledger.pending_upload(self.cfg.host) - adopted  # adopted: queued at old paths
        incarnation = self.ledger.require_manifest().incarnation  # now: the run may have been reset
        requeued, foreign = 0, []
        for tier in self.tiers.tiers:
            for path in runspec.spool_files(tier.dir, self.run):
                bid = path.name.removesuffix(".safetensors")
                if self.ledger.is_done(bid):
                    path.unlink(missing_ok=True)  # uploaded and verified; the delete was what got lost
                    continue
                if bid in pending:
                    continue
                spec = self.ledger.spec(bid)
                if spec is None:
                    log.warning("spool file %s: batch %s is not in run %s's plan; left, not uploaded", path, bid,
                                self.run)
                    continue
                try:
                    why = self.ledger.file_mismatch(path, spec, incarnation)
                except BatchFileError as exc:  # left for a re-extraction to overwrite
                    log.warning("spool file %s not uploaded: %s", path, exc)
                    continue
                if why:
                    path.unlink(missing_ok=True)
                    foreign.append(f"{bid} ({why})")
                    continue
                self.ledger.requeue_upload(self.cfg.host, bid, str(path), path.stat().st_size, file_sha256(path),
                                           tier.name)
                requeued += 1
        if requeued:
            log.info("re-enqueued uploads of %d spool files left from before", requeued)
        if foreign:
            log.warning("removed %d spool files of run %s that are not of this plan (they are extracted again): %s",
                        len(foreign), self.run, "; ".join(foreign[:3]))
        return requeued

    def adopt_legacy(self) -> set[str]:
        """Batch files an older hsx left in the old shared default /dev/shm/hsx/<run>/ (hsx.runspec.spool.LEGACY_MEMORY_DIR),
        moved into this worker's first tier when its memory folder is the default one; their batch ids."""
        if self.cfg.memory_spool_dir is None or \
                Path(self.cfg.memory_spool_dir) != runspec.default_memory_dir(self.cfg.redis_url):
            return set()  # a folder given by flag: the person chose it (compose gives /dev/shm/hsx itself)
        moved = runspec.adopt_legacy_spool(self.run, self.tiers.tiers[0].dir, runspec.LEGACY_MEMORY_DIR)
        if moved:
            log.warning("moved %d spool files of run %s from the old shared memory folder %s to %s; their uploads "
                        "are queued again", len(moved), self.run, runspec.LEGACY_MEMORY_DIR, self.tiers.tiers[0].dir)
        return {p.name.removesuffix(".safetensors") for p in moved}
