"""`hsx upload`: an rq SimpleWorker on this host's upload queue. Run several side by side."""

from __future__ import annotations

import logging
import time

from rq.serializers import JSONSerializer
from rq.worker import SimpleWorker

from hsx import ledger, queues
from hsx.config import UploadConfig
from hsx.redisconn import connect
from hsx.retry import backoff_delays
from uploader.jobs import SpoolFileLost

log = logging.getLogger(__name__)


def make_failure_handler(r, max_attempts: int):
    def on_failure(job, exc_type, exc_value, tb):
        kw = job.kwargs or {}
        run, bid, attempt = kw.get("run"), kw.get("batch_id"), int(kw.get("attempt", 1))
        if not run or not bid:
            return True
        if issubclass(exc_type, SpoolFileLost):
            # The bytes are gone: the batch must be computed again.
            log.error("%s: %s; re-enqueueing extraction", bid, exc_value)
            attempts = ledger.record_failure(r, run, bid, f"upload: {exc_value}", max_attempts)
            if attempts < max_attempts:
                queues.enqueue_extract(r, run, bid, attempt=100 + attempt)
            return True
        # Store trouble (outage, throttling, verify mismatch): the file stays; try again after a backoff.
        delay = list(backoff_delays(min(attempt, 8) + 1, base_seconds=1.0, cap_seconds=60.0))[-1]
        log.warning("upload of %s failed (attempt %d: %s); retrying in %.1fs", bid, attempt, exc_value, delay)
        time.sleep(delay)
        queues.enqueue_upload(r, job.origin.split("@", 1)[1], run, bid, kw["path"], kw["size"], kw["sha256"],
                              attempt=attempt + 1)
        return True

    return on_failure


def run_uploader(cfg: UploadConfig) -> None:
    r = connect(cfg.redis_url)
    worker = SimpleWorker([queues.queue(r, queues.upload_queue_name(cfg.host))], connection=r, name=cfg.worker_name,
                          serializer=JSONSerializer, job_class=queues.HsxJob,
                          exception_handlers=[make_failure_handler(r, cfg.max_attempts)])
    worker.work(burst=cfg.burst, logging_level="WARNING")
