"""`hsx upload`: an rq SimpleWorker on this host's upload queue. Run several side by side."""

from __future__ import annotations

import logging

from hsx import life
from hsx.fleet import check_eviction_policy
from hsx.localdirs import ensure_dir
from hsx.redisconn import connect, redact
from hsx.runspec import UploadConfig
from hsx.store import check_integrity, check_store

# Imported now, not inside the first job: it pulls in torch, seconds between rq's hand-over
# and the job's lease that the reconciler would count as a lost batch.
from uploader import jobs, runtime  # noqa: F401
from uploader.runtime import UploaderRuntime, UploadsRefused

log = logging.getLogger(__name__)


def check_run_stores(r) -> None:
    """The start check of each S3 store an unfinished run of this Redis uploads to (once a store): one that is
    unreachable, refuses these credentials or a write is StoreUnusable (exit 2) within seconds, naming the setting;
    so is --s3-integrity crc32 on a server that does not check it (the integrity probe)."""
    checked = set()
    for run in life.Run.names(r):
        ledger = life.Run(r, run)
        manifest = ledger.manifest()
        if manifest is None or ledger.complete() or manifest.store in checked:
            continue
        check_store(manifest.store, "uploader", run=run)
        check_integrity(manifest.store, "uploader", run=run)
        checked.add(manifest.store)


def run_uploader(cfg: UploadConfig) -> UploaderRuntime:
    """Serve upload@<host> until stopped (or, with ``burst``, until the queue is empty); returns the runtime."""
    # Uploaded files are removed from the spool: a spool this process cannot write would only fill up.
    ensure_dir(cfg.spool_dir, "spool", "--spool-dir / HSX_SPOOL_DIR")
    r = connect(cfg.redis_url, ride_out=True)
    check_eviction_policy(r, f"Redis at {redact(cfg.redis_url)}")
    check_run_stores(r)
    rt = UploaderRuntime(cfg, r)
    rt.serve()
    if rt.refused and cfg.burst:
        raise UploadsRefused(f"{rt.refused} upload job(s) refused on host {cfg.host} ({', '.join(sorted(rt.refusals))}): "
                             "they are back on the queue; fix this uploader's settings (see the error above) and rerun")
    return rt
