"""A run handle's verbs (``RunVerbs``, a part of ``hsx.life.Run``): a batch's changes of state, the producer's
feeding, and the roles' leases and heartbeats, each one call into hsx/life/batchlife.py, leases.py or
heartbeat.py with the run and its limits filled in.

batchlife and the queues import rq: they are imported on first use, inside the verbs, so ``import hsx.life``
(and a follower reading the ledger in a venv without rq) costs no rq.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import redis

from hsx.life import heartbeat, leases, ledger

if TYPE_CHECKING:
    from rq import Queue

    from hsx.life.batchlife import Failure
    from hsx.life.keys import RunKeys
    from hsx.life.ledger import BatchSpec, Manifest
    from hsx.life.queues import UploadJob
    from hsx.life.uploadpolicy import UploadFailure
    from hsx.runspec import RunLimits


class RunVerbs:
    r: redis.Redis
    name: str
    keys: RunKeys
    limits: RunLimits

    # ---- the producer -----------------------------------------------------
    def save_plan(self, manifest: Manifest, specs: list[BatchSpec], totals: dict[str, int]) -> None:
        ledger.save_plan(self.r, self.name, manifest, specs, totals)

    def enqueue(self, bids: list[str], at_front: bool = False, first: bool = False, pipe=None) -> None:
        from hsx.life import batchlife
        batchlife.enqueue(self.r, self.name, bids, at_front=at_front, first=first, pipe=pipe)

    def start_feeding(self) -> None:
        from hsx.life import batchlife
        batchlife.start_feeding(self.r, self.name)

    def fed_count(self) -> int | None:
        from hsx.life import batchlife
        return batchlife.fed_count(self.r, self.name)

    def feed(self, limit: int | None = None, ahead: int | None = None, pipe=None) -> int:
        from hsx.life import batchlife
        return batchlife.feed(self.r, self.name, limit=limit, ahead=ahead, pipe=pipe)

    def withdraw(self) -> int:
        from hsx.life import batchlife
        return batchlife.withdraw(self.r, self.name)

    def retry(self, bids: list[str] | None = None) -> list[str]:
        from hsx.life import batchlife
        return batchlife.retry(self.r, self.name, bids)

    def pending_extract(self) -> set[str]:
        from hsx.life import queues
        return queues.pending_extract(self.r, self.name)

    def pending_upload(self, host: str) -> set[str]:
        from hsx.life import queues
        return queues.pending_upload(self.r, host, self.name)

    @property
    def extract_queue_name(self) -> str:
        from hsx.life import queues
        return queues.extract_queue_name(self.name)

    def extract_queue(self) -> Queue:
        """The run's rq queue of extract jobs (its length: what is fed and not yet taken)."""
        from hsx.life import queues
        return queues.queue(self.r, queues.extract_queue_name(self.name))

    # ---- a batch, extracted ------------------------------------------------
    def lease(self, bid: str, lease_seconds: float | None = None) -> BatchSpec | None:
        from hsx.life import batchlife
        return batchlife.lease(self.r, self.name, bid, self.limits.lease_seconds if lease_seconds is None else lease_seconds)

    def release(self, bid: str) -> None:
        from hsx.life import batchlife
        batchlife.release(self.r, self.name, bid)

    def release_if_done(self, bid: str) -> bool:
        from hsx.life import batchlife
        return batchlife.release_if_done(self.r, self.name, bid)

    def hand_back(self, bid: str, leased: bool = True) -> bool:
        from hsx.life import batchlife
        return batchlife.hand_back(self.r, self.name, bid, leased)

    def spool(self, bid: str, host: str, path: str, size: int, sha256: str, tier: str, pipe) -> None:
        from hsx.life import batchlife
        batchlife.spool(self.r, self.name, bid, host, path, size, sha256, tier, pipe)

    def fail(self, bid: str, error: str, requeue: bool = True, at_front: bool = False,
             kept_upload: UploadJob | None = None, lost_worker: str | None = None) -> Failure:
        from hsx.life import batchlife
        return batchlife.fail(self.r, self.name, bid, error, self.limits.max_attempts, requeue=requeue,
                              at_front=at_front, kept_upload=kept_upload, lost_worker=lost_worker)

    def reap(self, now: float | None = None) -> dict[str, list[str]]:
        from hsx.life import batchlife
        return batchlife.reap(self.r, self.name, self.limits.max_attempts, now)

    # ---- a batch, uploaded ------------------------------------------------
    def requeue_upload(self, host: str, bid: str, path: str, size: int, sha256: str, tier: str,
                       retry: int = 0, at_front: bool = False) -> None:
        from hsx.life import batchlife
        batchlife.requeue_upload(self.r, host, self.name, bid, path, size, sha256, tier, retry=retry, at_front=at_front)

    def uploading(self, bid: str, job: UploadJob, lease_seconds: float | None = None) -> AbstractContextManager[None]:
        from hsx.life import batchlife
        return batchlife.uploading(self.r, self.name, bid, job,
                                   self.limits.lease_seconds if lease_seconds is None else lease_seconds)

    def finish(self, spec: BatchSpec, key: str, size: int, sha256: str, by: str, host: str | None = None) -> bool:
        from hsx.life import batchlife
        return batchlife.finish(self.r, self.name, spec, key, size, sha256, by, host)

    def upload_failed(self, bid: str, job: UploadJob, why: UploadFailure, error: str, retry: int,
                      wait: Callable[[float], None], count: bool = True) -> Failure | None:
        """``count=False``: a failure that is not the batch's (a job this host cannot serve), no attempt used."""
        from hsx.life import batchlife
        return batchlife.upload_failed(self.r, self.name, bid, job, why, error, retry,
                                       max_attempts=self.limits.max_attempts if count else 0, wait=wait)

    # ---- leases and heartbeats ---------------------------------------------
    def refresh_extract_leases(self, bids, pipe=None) -> None:
        leases.refresh_extract_leases(self.r, self.name, bids, self.limits.lease_seconds, pipe=pipe)

    def refresh_upload_leases(self, bids, pipe=None) -> None:
        leases.refresh_upload_leases(self.r, self.name, bids, self.limits.lease_seconds, pipe=pipe)

    def publish_heartbeat(self, worker: str, stats: dict, ttl_seconds: int, pipe=None) -> None:
        heartbeat.publish_heartbeat(self.r, self.name, worker, stats, ttl_seconds, pipe=pipe)

    def publish_stopped(self, worker: str, stats: dict) -> None:
        heartbeat.publish_stopped(self.r, self.name, worker, stats)

    def publish_current(self, worker: str, bid: str, pipe=None) -> None:
        heartbeat.publish_current(self.r, self.name, worker, bid, pipe=pipe)

    def publish_host(self, host: str, stats: dict, pipe=None) -> None:
        heartbeat.publish_host(self.r, self.name, host, stats, pipe=pipe)

    def worker_alive(self, worker: str) -> bool:
        return heartbeat.worker_alive(self.r, self.name, worker)

    def read_workers(self, malformed: list[str] | None = None) -> list[dict]:
        return heartbeat.read_workers(self.r, self.name, malformed=malformed)

    def read_hosts(self, malformed: list[str] | None = None) -> dict[str, dict]:
        return heartbeat.read_hosts(self.r, self.name, malformed)

    def sweep_heartbeats(self) -> list[str]:
        return heartbeat.sweep_heartbeats(self.r, self.name)

    def forget_dead_workers(self) -> list[str]:
        """rq's registry kept in step with the heartbeats: the run's rq workers with none are forgotten; their names."""
        from hsx.life import rqregistry
        return rqregistry.forget_dead_workers(self.r, self.name)
