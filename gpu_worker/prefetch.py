"""Fetch and lay out (pad, or pack into one row) the inputs of upcoming batches while the GPU works on the current one."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from gpu_worker.extractor import PackedBatch, PaddedBatch, pad_batch
from hsx.batch import INPUT_DIGEST_MISMATCH, BatchContents, BatchFileError, read_batch_bytes
from hsx.life import BatchSpec
from hsx.store import ObjectNotFound, layout

log = logging.getLogger(__name__)


FETCH_THREADS = 4  # concurrent input fetches


class Prefetcher:
    """A bounded cache batch_id -> Future[(PaddedBatch, BatchContents)], filled ahead of need.

    ``depth`` upcoming batches are fetched ahead. Inputs are small (~5 bytes a
    token), so a deep window is cheap and lets the GPU keep going through a
    store outage of depth x batch time while uploads wait.
    """

    def __init__(self, store, run: str, pad_id: int, pin: bool, depth: int, layout=None):
        """``layout(input_ids, cu_seqlens, padded_len, pad_id, pin)``: how the forward takes a batch (the
        extractor's ``batch``: packed or padded); default padded."""
        self.store, self.run, self.pad_id, self.pin, self.depth = store, run, pad_id, pin, depth
        self.layout = layout or pad_batch
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="hsx-prefetch")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def _load(self, spec: BatchSpec) -> tuple[PaddedBatch | PackedBatch, BatchContents]:
        key = layout.input_key(self.run, spec.shard, spec.batch_id)
        try:
            data = self.store.get_bytes(key)
        except ObjectNotFound:
            raise FileNotFoundError(f"inputs of {spec.batch_id} are missing from the store ({key}); re-run hsx produce") from None
        # The digest first: bytes that differ from the plan's are named as such (the producer rewrites
        # them on a re-run) whatever the decoder would make of them.
        if spec.input_sha256 and hashlib.sha256(data).hexdigest() != spec.input_sha256:
            raise BatchFileError(f"{key}: inputs of {spec.batch_id} {INPUT_DIGEST_MISMATCH} "
                                           "(changed or corrupt at rest); re-run hsx produce to rewrite them")
        contents = read_batch_bytes(data, where=key)  # names truncation / malformed files
        if not spec.ids_match(contents.sample_ids):   # the plan's ids, or their digest
            raise BatchFileError(f"{key}: sample ids differ from the plan of {spec.batch_id}")
        return self.layout(contents.input_ids, contents.cu_seqlens, spec.padded_len, self.pad_id, self.pin), contents

    def _future(self, spec: BatchSpec) -> Future:
        with self._lock:
            fut = self._cache.get(spec.batch_id)
            if fut is None:
                fut = self._pool.submit(self._load, spec)
                self._cache[spec.batch_id] = fut
                while len(self._cache) > 2 * self.depth + 2:
                    self._cache.popitem(last=False)
            return fut

    def cached(self, bid: str) -> bool:
        with self._lock:
            return bid in self._cache

    def hint(self, specs: list[BatchSpec]) -> None:
        """Start loading these (the next jobs in the queue), if not already."""
        for spec in specs[: self.depth]:
            self._future(spec)

    def take(self, spec: BatchSpec) -> tuple[PaddedBatch | PackedBatch, BatchContents]:
        """The batch's inputs. A fetch started ahead that failed (e.g. in a store outage while the worker
        waited for spool room) is tried once more now, so it does not count against the batch."""
        with self._lock:
            ahead = self._cache.get(spec.batch_id)
        fut = self._future(spec)
        try:
            return fut.result()
        except Exception:
            if ahead is None:
                raise
            log.info("prefetch of %s had failed; fetching its inputs again", spec.batch_id)
            return self._load(spec)
        finally:
            with self._lock:
                self._cache.pop(spec.batch_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
