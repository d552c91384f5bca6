"""`hsx upload`: an rq SimpleWorker on this host's upload queue. Run several side by side."""

from __future__ import annotations

import logging

from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from hsx import queues
from hsx.config import UploadConfig
from hsx.evictionpolicy import check_eviction_policy
from hsx.localdirs import ensure_dir
from hsx.redisconn import connect, redact

# Imported now, not inside the first job: it pulls in torch, seconds between rq's hand-over
# and the job's lease that the reconciler would count as a lost batch (issue 23 item 7).
from uploader import jobs, runtime  # noqa: F401
from uploader.runtime import UploaderRuntime

log = logging.getLogger(__name__)


def run_uploader(cfg: UploadConfig) -> UploaderRuntime:
    """Serve upload@<host> until stopped (or, with ``burst``, until the queue is empty); returns the runtime."""
    # Uploaded files are removed from the spool: a spool this process cannot write would only fill up.
    ensure_dir(cfg.spool_dir, "spool", "--spool-dir / HSX_SPOOL_DIR")
    r = connect(cfg.redis_url)
    check_eviction_policy(r, f"Redis at {redact(cfg.redis_url)}")
    rt = UploaderRuntime(cfg, r)
    runtime.install(rt)
    rt.start()
    worker = SimpleWorker([queues.queue(rt.r, queues.upload_queue_name(cfg.host))], connection=rt.r,
                          name=cfg.worker_name, serializer=JSONSerializer, job_class=queues.HsxJob)
    log.info("uploader %s on upload@%s, spool %s", cfg.worker_name, cfg.host, rt.spool_dir)
    try:
        worker.work(burst=cfg.burst, logging_level="WARNING")
    finally:
        rt.close()
        runtime.install(None)
        rt.log_progress()
    return rt
