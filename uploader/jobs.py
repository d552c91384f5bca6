"""rq job functions of the uploader.

Order of effects (never reordered): upload -> verify in the store -> record
done in the ledger (the last write) -> delete the local file. A failure at
any step leaves the spool file in place and the batch not done.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from hsx import index, layout, ledger
from hsx.batchfile import file_sha256
from hsx.config import StoreSettings

log = logging.getLogger(__name__)
_stores: dict[str, object] = {}


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


def upload_batch(run: str, batch_id: str, path: str, size: int, sha256: str, attempt: int = 1) -> str:
    from rq import get_current_job

    r = get_current_job().connection
    local = Path(path)
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
