"""rq's worker registry kept in step with hsx's heartbeats, so the /rq page agrees with `hsx status`.

A GPU worker killed with SIGKILL leaves its rq worker hash (alive until its TTL, up to the job
timeout), its queue registration and its job in the started registry: the rq views show it busy
with a batch the lease reaper has long re-enqueued. An rq worker on ``extract:<run>`` whose hsx
heartbeat (RunKeys.heartbeat, TTL a few beats) is gone is dead: it is unregistered, its hash
deleted and its job's execution taken out of the started registry (``Run.forget_dead_workers``, from each
role's housekeeping: hsx/fleet/housekeeping.py).
"""

from __future__ import annotations

import logging

import redis
from rq.registry import StartedJobRegistry
from rq.worker import Worker
from rq.worker_registration import unregister

from hsx.life import heartbeat, queues

log = logging.getLogger(__name__)


def forget_dead_workers(r: redis.Redis, run: str) -> list[str]:
    """Unregister the rq workers of ``run``'s extract queue with no hsx heartbeat; their names."""
    heartbeat.sweep_heartbeats(r, run)  # workers not seen for a day: their last heartbeat and batch go too
    q = queues.queue(r, queues.extract_queue_name(run))
    gone = []
    for worker in Worker.all(connection=r, queue=q):
        if heartbeat.worker_alive(r, run, worker.name):
            continue
        job_id = worker.get_current_job_id()
        job = q.fetch_job(job_id) if job_id else None
        if job is not None:
            StartedJobRegistry(queue=q).remove_executions(job)
        unregister(worker)
        r.delete(worker.key)
        gone.append(worker.name)
    if gone:
        log.info("rq registry: removed %d dead worker(s) of extract:%s (no hsx heartbeat): %s", len(gone), run,
                 ", ".join(gone))
    return gone
