"""rq job functions of the uploader.

Order of effects (never reordered): upload -> verify in the store -> record
done in the ledger (the last write) -> delete the local file. A failure at
any step leaves the spool file in place and the batch not done. The job finds
its process's state (host, spool, each run's store and limits) in
``UploaderRuntime.current()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from hsx import life
from hsx.batch import BatchFileError
from hsx.digest import file_sha256
from hsx.errors import NotPlanned
from hsx.life import RunVanished
from hsx.retry import pause
from hsx.runspec import RunNotVisible
from hsx.store import PermanentStoreError, layout
from uploader import runtime

log = logging.getLogger(__name__)


class SpoolFileLost(RuntimeError):
    """The spool file is gone or corrupt: the batch must be extracted again."""


class ForeignSpoolFile(SpoolFileLost):
    """The spool file is not of this plan (another incarnation of the run, other samples): never uploaded; the
    batch is extracted again (hsx/life/provenance.py)."""


# Which kind of upload failure an exception is (the first match); what each kind does is batchlife's table
# (hsx.life.UPLOAD_FAILURES). Anything else is store trouble: the file stays and the upload is tried again.
FAILURE_KINDS: tuple[tuple[type[BaseException], life.UploadFailure], ...] = (
    (SpoolFileLost, life.UploadFailure.LOST),
    (PermanentStoreError, life.UploadFailure.REFUSED),
    (NotPlanned, life.UploadFailure.UNPLANNED),
)


def failure_kind(exc: BaseException) -> life.UploadFailure:
    return next((kind for cls, kind in FAILURE_KINDS if isinstance(exc, cls)), life.UploadFailure.TROUBLE)


def upload_batch(run: str, batch_id: str, path: str, size: int, sha256: str, retry: int = 0, tier: str = "disk",
                 attempt: int | None = None) -> str:
    """``attempt``: carried by jobs an older hsx queued (a copy of the job id's suffix); never read."""
    rt = runtime.UploaderRuntime.current()
    job = life.UploadJob(rt.host, path, size, sha256, tier)
    try:
        local = rt.spool_file(run, batch_id, path, tier)  # before anything else: nothing read or deleted if refused
        ledger = rt.run_context(run).ledger
    except (runtime.OutsideSpool, RunNotVisible) as exc:
        here = life.Run(rt.r, run)   # no limits needed: nothing is counted against the batch here
        if isinstance(exc, runtime.OutsideSpool) and not _spool_mismatch(here, batch_id, path):
            raise  # a forged or stale job (another name, a done batch): refused, not put back
        # This uploader is set up unlike the host's workers (another --spool-dir, a store it cannot see). The job
        # goes back on the queue untouched, for an uploader that can do it: the batch stays queued, so it is
        # neither failed nor extracted again; the cause is counted and shown by `hsx status`.
        here.upload_failed(batch_id, job, life.UploadFailure.NOT_HERE, str(exc), retry, wait=pause,
                           count=False)  # nothing counted, no backoff: neither is used
        rt.refuse(run, exc)
        return f"{batch_id}: refused here ({exc}); put back on upload@{rt.host}"
    except RunVanished as exc:
        # Redis lost the run: no retry loop. The spool file stays; after `hsx produce` rebuilds the
        # ledger from the store, a restarted worker of this host re-enqueues its upload (SpoolRecovery.recover).
        log.error("%s: upload of %s stopped, spool file %s kept. Re-run `hsx produce` for the run (it rebuilds "
                  "the ledger from the store), then restart this host's workers", exc, batch_id, local)
        raise
    with ledger.uploading(batch_id, job):
        rt.in_progress = (run, batch_id)
        try:
            return _upload(rt, ledger, batch_id, local, size, sha256)
        except Exception as exc:
            # Counted here, shown on the run for a refusal (status, dashboard, /metrics: the store's message);
            # what happens to the batch is UPLOAD_FAILURES' row. A backoff is spent holding the lease (the
            # heartbeat keeps it); a stop request ends it, the next try is queued and the process exits.
            kind = failure_kind(exc)
            rt.record_failure()
            if kind is life.UploadFailure.REFUSED:
                ledger.record_store_refusal(batch_id, str(exc), rt.cfg.worker_name)
            failure = ledger.upload_failed(batch_id, job, kind, str(exc), retry, wait=_back_off(batch_id, kind, exc, retry))
            if kind is life.UploadFailure.REFUSED and failure.state is life.State.DEAD:
                log.error("upload of %s refused by the store %d times: spool file %s kept", batch_id,
                          failure.attempts, local)
            raise
        finally:
            rt.in_progress = None


def _back_off(batch_id: str, kind: life.UploadFailure, exc: Exception, retry: int) -> Callable[[float], None]:
    """The wait before the next try of an upload: one log line, then a pause a stop request ends."""
    def wait(delay: float) -> None:
        if kind is life.UploadFailure.REFUSED:
            log.error("upload of %s refused by the store; next try in %.1fs", batch_id, delay)
        else:
            log.warning("upload of %s failed (try %d: %s: %s); next try in %.1fs", batch_id, retry + 1,
                        type(exc).__name__, exc, delay)
        pause(delay)
    return wait


def _spool_mismatch(run: life.Run, batch_id: str, path: str) -> bool:
    """A worker's real spool file in a spool folder other than this uploader's: ``<dir>/<run>/<batch>.safetensors``
    of a batch not done yet. Anything else an OutsideSpool job names is forged or stale."""
    named = Path(path)
    return (named.name == f"{batch_id}.safetensors" and named.parent.name == run.name and ".." not in named.parts
            and not run.is_done(batch_id))


def _upload(rt: runtime.UploaderRuntime, run: life.Run, batch_id: str, local: Path, size: int, sha256: str) -> str:
    if run.is_done(batch_id):
        local.unlink(missing_ok=True)
        return f"{batch_id} already done"
    spec = run.spec(batch_id)
    if spec is None:
        raise NotPlanned(f"batch {batch_id} is not in the plan of run {run.name}")
    if not local.is_file():
        raise SpoolFileLost(f"spool file {local} of {batch_id} is missing")
    if local.stat().st_size != size:
        raise SpoolFileLost(f"spool file {local} is {local.stat().st_size} bytes, expected {size}")
    # The manifest read now, not cached: a run reset and planned again under a live uploader has a new incarnation.
    manifest = run.require_manifest()
    try:
        foreign = run.file_mismatch(local, spec, manifest.incarnation)
    except BatchFileError as exc:
        raise SpoolFileLost(f"spool file {local} is corrupt: {exc}") from None
    if foreign:
        raise ForeignSpoolFile(f"spool file {local} is not of this plan: {foreign}; not uploaded")
    store = rt.run_context(run.name).store
    key = layout.batch_key(run.name, spec.shard, batch_id)
    try:
        info = store.put_file(key, local, size, sha256)
        if rt.cfg.verify_readback:
            store.read_back(key, size, sha256)
    except Exception as exc:
        from hsx.store import VerifyError

        if isinstance(exc, VerifyError) and file_sha256(local) != sha256:
            raise SpoolFileLost(f"spool file {local} is corrupt (sha256 differs from what the worker wrote)") from exc
        raise
    run.finish(spec, key, info.size, sha256, by=rt.cfg.worker_name, host=rt.host)
    run.clear_store_refusal()  # the store takes uploads again
    local.unlink(missing_ok=True)
    rt.record_upload(size, run.name)
    run.write_index_if_complete(store)
    return f"{batch_id} -> {store.url(key)} ({size} bytes)"
