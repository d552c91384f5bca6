"""rq queues and jobs: names, ids, and the only functions a job may name.

Jobs carry small JSON kwargs (run, batch id, attempt, ...) under rq's JSON
serializer, never pickle. A job can only call a function in ALLOWED_FUNCS:
whoever can write to Redis cannot make a worker run anything else.
"""

from __future__ import annotations

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from hsx.defaults import DEFAULT_EXTRACT_JOB_TIMEOUT, DEFAULT_UPLOAD_JOB_TIMEOUT
from hsx.keys import RunKeys
from hsx.redisconn import zset_members

EXTRACT_FUNC = "gpu_worker.jobs.extract_batch"
UPLOAD_FUNC = "uploader.jobs.upload_batch"
ALLOWED_FUNCS = frozenset({EXTRACT_FUNC, UPLOAD_FUNC})
RESULT_TTL = 3600       # seconds rq keeps a finished job
FAILURE_TTL = 7 * 86400  # seconds rq keeps a failed job
PENDING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED, JobStatus.CREATED}


class ForbiddenJob(RuntimeError):
    """A job names a function hsx does not allow."""


class HsxJob(Job):
    @property
    def func(self):
        if self.func_name not in ALLOWED_FUNCS:
            raise ForbiddenJob(f"job {self.id} names {self.func_name!r}; hsx workers only run {sorted(ALLOWED_FUNCS)}")
        return super().func


def extract_queue_name(run: str) -> str:
    return f"extract:{run}"


def upload_queue_name(host: str) -> str:
    return f"upload@{host}"


def queue(r: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=r, serializer=JSONSerializer, job_class=HsxJob)


def extract_job_id(run: str, bid: str, attempt: int) -> str:
    return f"x-{run}-{bid}-{attempt}"


def upload_job_id(run: str, bid: str, attempt: int) -> str:
    return f"u-{run}-{bid}-{attempt}"


def batch_of_job(job_id: str) -> tuple[str, str, int] | None:
    """(run, batch id, attempt) of an hsx job id, else None."""
    kind, _, rest = job_id.partition("-")
    parts = rest.rsplit("-", 2)
    if kind not in ("x", "u") or len(parts) != 3 or not parts[0]:
        return None
    try:
        return parts[0], parts[1], int(parts[2])
    except ValueError:
        return None


def enqueue_extract(r: redis.Redis, run: str, bid: str, attempt: int = 1, pipeline=None, at_front: bool = False) -> Job:
    """``at_front`` for work taken back from a dead or stopping worker: it was next in line already."""
    return queue(r, extract_queue_name(run)).enqueue_call(
        EXTRACT_FUNC, kwargs={"run": run, "batch_id": bid, "attempt": attempt},
        job_id=extract_job_id(run, bid, attempt), timeout=DEFAULT_EXTRACT_JOB_TIMEOUT,
        result_ttl=RESULT_TTL, failure_ttl=FAILURE_TTL, description=f"extract {run}/{bid}", pipeline=pipeline,
        at_front=at_front)


def enqueue_upload(r: redis.Redis, host: str, run: str, bid: str, path: str, size: int, sha256: str,
                   attempt: int = 1, retry: int = 0, pipeline=None, at_front: bool = False) -> Job:
    """``attempt`` makes the job id unique; ``retry`` counts store failures of this upload (for backoff)."""
    return queue(r, upload_queue_name(host)).enqueue_call(
        UPLOAD_FUNC, kwargs={"run": run, "batch_id": bid, "path": path, "size": size, "sha256": sha256,
                             "attempt": attempt, "retry": retry},
        job_id=upload_job_id(run, bid, attempt), timeout=DEFAULT_UPLOAD_JOB_TIMEOUT,
        result_ttl=RESULT_TTL, failure_ttl=FAILURE_TTL, description=f"upload {run}/{bid}", pipeline=pipeline,
        at_front=at_front)


def _queued_batches(r: redis.Redis, queue_name: str, run: str) -> set[str]:
    found = set()
    for job_id in queue(r, queue_name).get_job_ids():
        parsed = batch_of_job(job_id)
        if parsed and parsed[0] == run:
            found.add(parsed[1])
    return found


def pending_extract(r: redis.Redis, run: str) -> set[str]:
    """Batches of ``run`` waiting on the extract queue or leased by a live worker."""
    return _queued_batches(r, extract_queue_name(run), run) | zset_members(r, RunKeys(run).extract_leases)


def pending_upload(r: redis.Redis, host: str, run: str) -> set[str]:
    """Batches of ``run`` waiting on ``host``'s upload queue or leased by a live uploader."""
    return _queued_batches(r, upload_queue_name(host), run) | zset_members(r, RunKeys(run).upload_leases)


def retry_dead_letters(r: redis.Redis, run: str, bids: list[str] | None = None) -> list[str]:
    """Move dead letters (all, or ``bids``) back onto the extract queue with fresh attempts."""
    from hsx import ledger

    taken = ledger.take_dead_letters(r, run, bids)
    for bid in taken:
        if not ledger.is_done(r, run, bid):
            enqueue_extract(r, run, bid, attempt=1000 + int(r.incr(RunKeys(run).job_seq)))
    return taken
