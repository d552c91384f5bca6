"""rq job functions of the uploader.

Order of effects (never reordered): upload -> verify in the store -> record
done in the ledger (the last write) -> delete the local file. A failure at
any step leaves the spool file in place and the batch not done.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from pathlib import Path

from hsx import index, layout, leases, ledger, queues
from hsx.batchfile import file_sha256
from hsx.config import StoreSettings

log = logging.getLogger(__name__)
_stores: dict[str, object] = {}
LEASE_SECONDS = 60            # set by the uploader process from its config
MAX_ATTEMPTS = 3              # re-extractions of a batch whose spool file is lost, before dead letters
RETRY_CAP_SECONDS = 60.0      # longest backoff between two uploads of one batch while the store is down
current: dict[str, str] = {}  # {"run", "batch_id"} of the upload in progress; the heartbeat refreshes its lease


class SpoolFileLost(RuntimeError):
    """The spool file is gone or corrupt: the batch must be extracted again."""


def store_for(r, run: str):
    """The run's store, opened once per process from the settings the run recorded."""
    if run not in _stores:
        manifest = ledger.get_manifest(r, run)
        if manifest is None:
            raise KeyError(f"run {run!r} has no manifest in Redis")
        _stores[run] = StoreSettings.resolve(None, recorded=manifest["store"]).open()
    return _stores[run]


def upload_batch(run: str, batch_id: str, path: str, size: int, sha256: str, attempt: int = 1, retry: int = 0) -> str:
    from rq import get_current_job

    job = get_current_job()
    r = job.connection
    host = job.origin.split("@", 1)[1]
    leases.take_upload(r, run, batch_id, {"host": host, "path": path, "size": size, "sha256": sha256}, LEASE_SECONDS)
    current.update(run=run, batch_id=batch_id)
    try:
        return _upload(r, run, batch_id, Path(path), size, sha256)
    except SpoolFileLost as exc:
        # The bytes are gone: the batch must be computed again.
        attempts = ledger.record_failure(r, run, batch_id, f"upload: {exc}", MAX_ATTEMPTS)
        if attempts < MAX_ATTEMPTS:
            queues.enqueue_extract(r, run, batch_id, attempt=leases.next_attempt(r, run))
        log.error("%s; re-enqueued its extraction (failure %d/%d)", exc, attempts, MAX_ATTEMPTS)
        raise
    except Exception as exc:
        # Store trouble (outage, throttling, verify mismatch): the file stays. Back off while
        # holding the lease (the heartbeat keeps it), then queue the next try and fail this job.
        delay = random.uniform(0, min(RETRY_CAP_SECONDS, 2.0 ** retry))
        log.warning("upload of %s failed (try %d: %s: %s); next try in %.1fs", batch_id, retry + 1,
                    type(exc).__name__, exc, delay)
        time.sleep(delay)
        queues.enqueue_upload(r, host, run, batch_id, path, size, sha256, attempt=leases.next_attempt(r, run),
                              retry=retry + 1)
        raise
    finally:
        current.clear()
        leases.drop_upload(r, run, batch_id)


def _upload(r, run: str, batch_id: str, local: Path, size: int, sha256: str) -> str:
    if ledger.is_done(r, run, batch_id):
        local.unlink(missing_ok=True)
        return f"{batch_id} already done"
    spec = ledger.get_spec(r, run, batch_id)
    if spec is None:
        raise KeyError(f"batch {batch_id} is not in the plan of run {run}")
    if not local.is_file():
        raise SpoolFileLost(f"spool file {local} of {batch_id} is missing")
    if local.stat().st_size != size:
        raise SpoolFileLost(f"spool file {local} is {local.stat().st_size} bytes, expected {size}")
    store = store_for(r, run)
    key = layout.batch_key(run, spec.shard, batch_id)
    try:
        info = store.put_file(key, local, size, sha256)
    except Exception as exc:
        from hsx.store import VerifyError

        if isinstance(exc, VerifyError) and file_sha256(local) != sha256:
            raise SpoolFileLost(f"spool file {local} is corrupt (sha256 differs from what the worker wrote)") from exc
        raise
    ledger.mark_done(r, run, spec, key, info.size, sha256, by=f"{socket.gethostname()}:{os.getpid()}")
    local.unlink(missing_ok=True)
    index.write_index_if_complete(r, store, run)
    return f"{batch_id} -> {store.url(key)} ({size} bytes)"
