"""Incomplete multipart uploads of a run: found by `hsx verify`, aborted by uploaders at start-up.

An uploader killed mid-upload leaves a started multipart upload in the store: its parts are billed
storage that no listing of objects shows. One is *stale* when both hold:
- no live upload lease (``upload_leases``, expiry on Redis' clock) holds its batch: a live upload
  leases its batch before it starts and keeps the lease until the upload is complete;
- it was started at least the run's lease length ago, on the store's clock (the Date of the listing
  against the upload's Initiated time), so the leases, read *before* the listing, were read after it
  started: a live upload then shows up there.
Aborting a stale upload is safe: no live process will complete it. A live one of another uploader
(any host) is never touched. Stores without multipart uploads (a local directory) have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

import redis

from hsx import life
from hsx.life import RunKeys


@dataclass(frozen=True)
class IncompleteUpload:
    key: str
    upload_id: str
    age_seconds: float   # on the store's clock
    stale: bool


def incomplete_uploads(r: redis.Redis, store, run: str, lease_seconds: float) -> list[IncompleteUpload]:
    """Every incomplete multipart upload under ``<run>/`` in ``store``, each marked stale or not."""
    listing = getattr(store, "incomplete_uploads", None)
    if listing is None:
        return []
    keys = RunKeys(run)
    now = life.redis_now(r)
    live = {batch.decode() if isinstance(batch, bytes) else batch
            for batch in r.zrangebyscore(keys.upload_leases, now, "+inf")}  # read before the listing
    found = []
    for key, upload_id, age in listing(f"{run}/"):
        batch = PurePosixPath(key).name.split(".", 1)[0]  # <run>/batches/<shard>/<batch>.safetensors
        found.append(IncompleteUpload(key, upload_id, age, stale=batch not in live and age >= lease_seconds))
    return found


def abort_stale_uploads(r: redis.Redis, store, run: str, lease_seconds: float) -> list[IncompleteUpload]:
    """Abort the run's stale multipart uploads; returns those aborted."""
    stale = [u for u in incomplete_uploads(r, store, run, lease_seconds) if u.stale]
    for upload in stale:
        store.abort_upload(upload.key, upload.upload_id)
    return stale
