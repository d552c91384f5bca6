"""`hsx upload`: an rq SimpleWorker on this host's upload queue. Run several side by side."""

from __future__ import annotations

import logging
import threading

from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from hsx import leases, ledger, queues
from hsx.config import UploadConfig
from hsx.keys import RunKeys
from hsx.redisconn import connect
from uploader import jobs as upload_jobs

log = logging.getLogger(__name__)


def _heartbeat(r, cfg: UploadConfig, stop: threading.Event) -> None:
    """Refresh the lease of the upload in progress; reclaim uploads of dead uploaders."""
    while not stop.wait(cfg.heartbeat_seconds):
        try:
            job = dict(upload_jobs.current)
            if job:
                leases.refresh(r, RunKeys(job["run"]).upload_leases, [job["batch_id"]], cfg.lease_seconds)
            for run in ledger.list_runs(r):
                leases.reap(r, run, cfg.max_attempts)
        except Exception as exc:  # Redis away: the job itself will notice; try again next beat
            log.warning("uploader heartbeat failed: %s", exc)


def run_uploader(cfg: UploadConfig) -> None:
    r = connect(cfg.redis_url)
    upload_jobs.LEASE_SECONDS, upload_jobs.MAX_ATTEMPTS = cfg.lease_seconds, cfg.max_attempts
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(r, cfg, stop), name="hsx-upload-heartbeat", daemon=True)
    beat.start()
    worker = SimpleWorker([queues.queue(r, queues.upload_queue_name(cfg.host))], connection=r, name=cfg.worker_name,
                          serializer=JSONSerializer, job_class=queues.HsxJob)
    try:
        worker.work(burst=cfg.burst, logging_level="WARNING")
    finally:
        stop.set()
        beat.join(timeout=5)
