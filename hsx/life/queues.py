"""rq queues and jobs: names, ids, and the only functions a job may name.

Jobs carry small JSON kwargs (run, batch id, ...) under rq's JSON
serializer, never pickle. Whoever can write to Redis must not be able to run
code in any hsx process (docs/architecture.md, rule 5), so:

- every hsx process makes rq's default serializer JSON at its entry (``rq_without_pickle``: the CLI's
  ``main``, a role's ``serve``, the dashboard's ``create_app``): rq and rq-dashboard fall back to that default wherever
  no serializer is passed (``Job.fetch`` in rq-dashboard's job view, ``Worker.all``,
  ``requeue_job``, the group clean-up of every worker), and none of those can
  unpickle Redis data any more; bytes that are not JSON read as unreadable;
- a job can only call a function in ALLOWED_FUNCS, as a plain function (no instance); a role's
  worker (``job_class``) only the functions of that role;
- ``HsxJob`` drops what rq would otherwise take from the job hash and act on:
  success/failure/stopped callbacks (imported and called by name), dependencies,
  webhooks (HTTP requests to any URL), rq-level retries and repeats. hsx sets
  none of these; a job that carries one was written by someone else.
"""

from __future__ import annotations

import json
import logging
from typing import NamedTuple

import redis
from rq import Queue
from rq import serializers as rq_serializers
from rq.job import Job
from rq.serializers import JSONSerializer

from hsx.defaults import DEFAULT_EXTRACT_JOB_TIMEOUT, DEFAULT_UPLOAD_JOB_TIMEOUT
from hsx.errors import HsxError
from hsx.life.keys import RunKeys
from hsx.redisconn import zset_members

EXTRACT_FUNC = "gpu_worker.jobs.extract_batch"
UPLOAD_FUNC = "uploader.jobs.upload_batch"
ALLOWED_FUNCS = frozenset({EXTRACT_FUNC, UPLOAD_FUNC})
RESULT_TTL = 0          # seconds rq keeps a finished job: none. The ledger says what finished; a finished job's
                        # hash, result stream and registry entry cost ~7 KB a batch for an hour
FAILURE_TTL = 7 * 86400  # seconds rq keeps a failed job


class UploadJob(NamedTuple):
    """One spool file to upload: the host whose spool holds it, its path, size (bytes), SHA-256 and spool tier.

    Encoded here only, in two forms that older hsx versions wrote the same way: the rq job's kwargs
    (``kwargs``; the uploader's ``upload_batch`` takes them, the host is the queue's) and the JSON of the
    ``upload_jobs`` and ``kept_uploads`` hashes (``to_json``/``from_json``: a record without a tier is an
    older hsx's, on disk).
    """

    host: str
    path: str
    size: int
    sha256: str
    tier: str = "disk"

    def kwargs(self, run: str, bid: str, retry: int = 0) -> dict:
        """The rq job's kwargs (``retry``: store failures of this upload so far, for the uploader's backoff)."""
        return {"run": run, "batch_id": bid, "path": self.path, "size": self.size, "sha256": self.sha256,
                "retry": retry, "tier": self.tier}

    def to_json(self) -> str:
        return json.dumps(self._asdict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> UploadJob:
        job = json.loads(raw)
        return cls(job["host"], job["path"], job["size"], job["sha256"], job.get("tier", "disk"))


log = logging.getLogger(__name__)


def rq_without_pickle() -> None:
    """Make rq's default serializer (pickle, also reachable as 'pickle') read and write JSON, in this process.

    Idempotent; called at each process entry (hsx_cli.main.main, hsx.fleet.role.Role.serve,
    dashboard.app.create_app), never as a side effect of an import.
    """
    rq_serializers.DefaultSerializer.dumps = staticmethod(JSONSerializer.dumps)
    rq_serializers.DefaultSerializer.loads = staticmethod(JSONSerializer.loads)


class ForbiddenJob(HsxError, RuntimeError):
    """A job names a function hsx does not allow."""


class HsxJob(Job):
    """An rq job as hsx workers see it: an allowed function, JSON kwargs, and nothing else from Redis."""

    allowed = ALLOWED_FUNCS

    @property
    def func(self):
        if self.func_name not in self.allowed:
            raise ForbiddenJob(f"job {self.id} names {self.func_name!r}; this worker only runs {sorted(self.allowed)}")
        if self.instance is not None:
            raise ForbiddenJob(f"job {self.id} calls {self.func_name!r} on an instance; hsx jobs call plain functions")
        return super().func

    def restore(self, raw_data) -> None:
        super().restore(raw_data)
        dropped = []
        for attr, label in (("_success_callback_name", "on_success"), ("_failure_callback_name", "on_failure"),
                            ("_stopped_callback_name", "on_stopped")):
            if getattr(self, attr):
                dropped.append(f"{label}={getattr(self, attr)!r}")
                setattr(self, attr, None)
        if self._dependency_ids:
            dropped.append(f"depends_on={len(self._dependency_ids)} jobs")
            self._dependency_ids = []
        if self.webhooks:
            dropped.append(f"webhooks={len(self.webhooks)}")
            self.webhooks = []
        if self.retries_left or self.retry_intervals:
            dropped.append("retry")
            self.retries_left, self.retry_intervals = None, None
        if self.repeats_left or self.repeat_intervals:
            dropped.append("repeat")
            self.repeats_left, self.repeat_intervals = None, None
        if dropped:
            log.warning("job %s carried %s from Redis; hsx never sets these, ignored", self.id, ", ".join(dropped))


def job_class(funcs) -> type[HsxJob]:
    """HsxJob for a role's worker: it runs only ``funcs`` ("module.function", the role's own jobs)."""
    return type("HsxJob", (HsxJob,), {"allowed": frozenset(funcs)})


def extract_queue_name(run: str) -> str:
    return f"extract:{run}"


def upload_queue_name(host: str) -> str:
    return f"upload@{host}"


def queue(r: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=r, serializer=JSONSerializer, job_class=HsxJob)


def extract_job_id(run: str, bid: str, seq: int) -> str:
    """``seq`` only makes the id unique (hsx.life.batchlife.next_seqs)."""
    return f"x-{run}-{bid}-{seq}"


def upload_job_id(run: str, bid: str, seq: int) -> str:
    return f"u-{run}-{bid}-{seq}"


def batch_of_job(job_id: str) -> tuple[str, str, int] | None:
    """(run, batch id, suffix) of an hsx job id, else None."""
    kind, _, rest = job_id.partition("-")
    parts = rest.rsplit("-", 2)
    if kind not in ("x", "u") or len(parts) != 3 or not parts[0]:
        return None
    try:
        return parts[0], parts[1], int(parts[2])
    except ValueError:
        return None


# Only hsx.life.batchlife calls these two: an enqueue is a transition of the batch's state (tests/test_batchlife.py).
def enqueue_extract(r: redis.Redis, run: str, bid: str, seq: int, pipeline=None, at_front: bool = False) -> Job:
    """``at_front`` for work taken back from a dead or stopping worker: it was next in line already."""
    return queue(r, extract_queue_name(run)).enqueue_call(
        EXTRACT_FUNC, kwargs={"run": run, "batch_id": bid},
        job_id=extract_job_id(run, bid, seq), timeout=DEFAULT_EXTRACT_JOB_TIMEOUT,
        result_ttl=RESULT_TTL, failure_ttl=FAILURE_TTL, description=f"extract {run}/{bid}", pipeline=pipeline,
        at_front=at_front)


def enqueue_upload(r: redis.Redis, host: str, run: str, bid: str, path: str, size: int, sha256: str, seq: int,
                   retry: int = 0, pipeline=None, at_front: bool = False, tier: str = "disk") -> Job:
    """``seq`` makes the job id unique; ``retry`` counts store failures of this upload (for backoff);
    ``tier``: the spool tier holding the file (memory | disk; the uploader checks ``path`` is that tier's file)."""
    return enqueue_upload_job(r, run, bid, UploadJob(host, path, size, sha256, tier), seq, retry=retry,
                              pipeline=pipeline, at_front=at_front)


def enqueue_upload_job(r: redis.Redis, run: str, bid: str, job: UploadJob, seq: int, retry: int = 0, pipeline=None,
                       at_front: bool = False) -> Job:
    """``enqueue_upload`` of a typed ``UploadJob`` (on its host's queue)."""
    return queue(r, upload_queue_name(job.host)).enqueue_call(
        UPLOAD_FUNC, kwargs=job.kwargs(run, bid, retry),
        job_id=upload_job_id(run, bid, seq), timeout=DEFAULT_UPLOAD_JOB_TIMEOUT,
        result_ttl=RESULT_TTL, failure_ttl=FAILURE_TTL, description=f"upload {run}/{bid}", pipeline=pipeline,
        at_front=at_front)


def queued_batches(r: redis.Redis, queue_name: str, run: str) -> set[str]:
    found = set()
    for job_id in queue(r, queue_name).get_job_ids():
        parsed = batch_of_job(job_id)
        if parsed and parsed[0] == run:
            found.add(parsed[1])
    return found


def pending_extract(r: redis.Redis, run: str) -> set[str]:
    """Batches of ``run`` waiting on the extract queue or leased by a live worker."""
    return queued_batches(r, extract_queue_name(run), run) | zset_members(r, RunKeys(run).extract_leases)


def pending_upload(r: redis.Redis, host: str, run: str) -> set[str]:
    """Batches of ``run`` waiting on ``host``'s upload queue or leased by a live uploader."""
    return queued_batches(r, upload_queue_name(host), run) | zset_members(r, RunKeys(run).upload_leases)
