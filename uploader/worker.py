"""`hsx upload`: an rq SimpleWorker on this host's upload queue. Run several side by side."""

from __future__ import annotations

import logging

from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from hsx.config import UploadConfig
from hsx.localdirs import ensure_dir
from hsx.redisconn import connect, redact
from hsx.run import ledger, multipart, queues
from hsx.run.evictionpolicy import check_eviction_policy

# Imported now, not inside the first job: it pulls in torch, seconds between rq's hand-over
# and the job's lease that the reconciler would count as a lost batch (issue 23 item 7).
from uploader import jobs, runtime  # noqa: F401
from uploader.runtime import UploaderRuntime, UploadsRefused

log = logging.getLogger(__name__)


def run_uploader(cfg: UploadConfig) -> UploaderRuntime:
    """Serve upload@<host> until stopped (or, with ``burst``, until the queue is empty); returns the runtime."""
    # Uploaded files are removed from the spool: a spool this process cannot write would only fill up.
    ensure_dir(cfg.spool_dir, "spool", "--spool-dir / HSX_SPOOL_DIR")
    r = connect(cfg.redis_url, ride_out=True)
    check_eviction_policy(r, f"Redis at {redact(cfg.redis_url)}")
    rt = UploaderRuntime(cfg, r)
    runtime.install(rt)
    rt.start()
    _abort_stale_multipart(rt)
    worker = SimpleWorker([queues.queue(rt.r, queues.upload_queue_name(cfg.host))], connection=rt.r,
                          name=cfg.worker_name, serializer=JSONSerializer, job_class=queues.HsxJob)
    if cfg.burst:
        rt.on_refused = lambda: setattr(worker, "_stop_requested", True)
    log.info("ready: uploader %s taking jobs from upload@%s, spool %s", cfg.worker_name, cfg.host, rt.spool_dir)
    try:
        worker.work(burst=cfg.burst, logging_level="WARNING")
    finally:
        rt.close()
        runtime.install(None)
        rt.log_progress(final=True)
    if rt.refused and cfg.burst:
        raise UploadsRefused(f"{rt.refused} upload job(s) refused on host {cfg.host} ({', '.join(sorted(rt.refusals))}): "
                             "they are back on the queue; fix this uploader's settings (see the error above) and rerun")
    return rt


def _abort_stale_multipart(rt: UploaderRuntime) -> None:
    """Abort each run's multipart uploads that uploaders killed mid-upload left (hsx/run/multipart.py says which
    are safe to abort: never a live one of another uploader). A store that cannot be reached is no reason
    not to start: the next start or `hsx verify --repair` tries again."""
    for run in ledger.list_runs(rt.r):
        try:
            aborted = multipart.abort_stale(rt.r, rt.run_context(run).store, run, rt.run_context(run).limits.lease_seconds)
        except Exception as exc:
            log.warning("run %s: could not check for stale multipart uploads: %s", run, exc)
            continue
        if aborted:
            log.warning("run %s: aborted %d incomplete multipart uploads left by killed uploaders: %s", run,
                        len(aborted), ", ".join(u.key for u in aborted[:5]))
