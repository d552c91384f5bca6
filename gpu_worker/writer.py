"""The writer thread: device -> pinned host memory -> spool file -> upload job.

The GPU thread hands over a finished batch and goes on at once. The copy to
host runs on a side CUDA stream into a reused pinned buffer; this thread
waits for it, validates, writes the file atomically, and enqueues the upload
in one Redis pipeline with dropping the batch's lease. The queue is bounded (the GPU
thread blocks only if disk is slower than the GPU).
"""

from __future__ import annotations

import json
import logging
import queue as stdqueue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from hsx import batchfile, layout, leases, ledger, queues
from hsx.keys import RunKeys
from hsx.ledger import BatchSpec

log = logging.getLogger(__name__)
# Writer threads: one file is written and hashed while the other is fsynced, so
# one slow fsync does not hold the GPU thread (measured in bench/gpu_bench.py).
WRITER_THREADS = 2


@dataclass
class Finished:
    spec: BatchSpec
    attempt: int
    contents: batchfile.BatchContents
    hidden: torch.Tensor               # [N, n*H] on the host (pinned view, or CPU tensor)
    final: torch.Tensor | None
    finite: torch.Tensor               # 0-dim bool on the host
    ready: object | None               # torch.cuda.Event to wait on, or None
    release: Callable[[], None]        # give the pinned buffer back


class PinnedPool:
    """Reused pinned host buffers, so host memory stays flat over a long run."""

    def __init__(self, count: int, numel: int, dtype: torch.dtype):
        self._free: stdqueue.Queue = stdqueue.Queue()
        for _ in range(count):
            self._free.put(torch.empty(numel, dtype=dtype, pin_memory=True))
        self.numel = numel

    def get(self) -> torch.Tensor:
        return self._free.get()

    def put(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


class SpoolWriter:
    def __init__(self, r, run: str, manifest: dict, spool_dir: Path, host: str, worker_name: str,
                 on_failure: Callable[[str, int, str], None], depth: int, fsync: bool = True):
        self.r, self.run, self.manifest = r, run, manifest
        self.spool_dir, self.host, self.worker_name = Path(spool_dir), host, worker_name
        self.on_failure, self.fsync = on_failure, fsync
        self._q: stdqueue.Queue = stdqueue.Queue(maxsize=depth)
        self._threads = [threading.Thread(target=self._loop, name=f"hsx-writer-{i}", daemon=True)
                         for i in range(WRITER_THREADS)]
        self.written = 0          # batches spooled by this process
        self.bytes_written = 0
        self.in_flight: set[str] = set()
        self._idle = threading.Condition()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, item: Finished) -> None:
        with self._idle:
            self.in_flight.add(item.spec.batch_id)
        self._q.put(item)

    def held(self) -> set[str]:
        """Batches submitted and not yet written (a copy: writer threads change the set)."""
        with self._idle:
            return set(self.in_flight)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted batch is written (or failed). True if drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self.in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            try:
                self._write(item)
            except Exception as exc:
                log.error("batch %s failed at write: %s", item.spec.batch_id, exc)
                self.on_failure(item.spec.batch_id, item.attempt, f"write: {type(exc).__name__}: {exc}")
            finally:
                item.release()
                with self._idle:
                    self.in_flight.discard(item.spec.batch_id)
                    self._idle.notify_all()

    def _write(self, item: Finished) -> None:
        spec, contents = item.spec, item.contents
        if item.ready is not None:
            item.ready.synchronize()  # also before a skip: the pinned buffer is reused once released
        if ledger.is_done(self.r, self.run, spec.batch_id):  # a duplicate delivery finished elsewhere first
            leases.drop(self.r, RunKeys(self.run).extract_leases, spec.batch_id)
            return
        tensors = {"hidden_states": item.hidden, "input_ids": contents.input_ids.to(torch.int32),
                   "loss_mask": contents.loss_mask.to(torch.uint8), "cu_seqlens": contents.cu_seqlens.to(torch.int64)}
        if item.final is not None:
            tensors["final_hidden_states"] = item.final
        if not bool(item.finite):
            batchfile.validate(tensors, spec.sample_ids, check_finite=True)  # names the sample, raises
            raise batchfile.BatchFileError("hidden states hold NaN/Inf")
        batchfile.validate(tensors, spec.sample_ids, check_finite=False)
        m = self.manifest
        metadata = {"format": batchfile.FORMAT, "run": self.run, "batch_id": spec.batch_id,
                    "sample_ids": json.dumps(spec.sample_ids), "layer_ids": json.dumps(m["layer_ids"]),
                    "dtype": m["dtype"], "model": m["model"], "hidden_size": str(m["hidden_size"]),
                    "store_final": str(bool(m["store_final"])).lower()}
        path = layout.spool_path(self.spool_dir, self.run, spec.batch_id)
        size, sha = batchfile.write_atomic(path, tensors, metadata, fsync=self.fsync, tmp_tag=self.worker_name)
        pipe = self.r.pipeline()
        queues.enqueue_upload(self.r, self.host, self.run, spec.batch_id, str(path), size, sha, pipeline=pipe)
        ledger.mark_spooled(self.r, self.run, spec.batch_id, pipe=pipe)
        ledger.clear_failure(self.r, self.run, spec.batch_id, pipe=pipe)
        leases.drop(self.r, RunKeys(self.run).extract_leases, spec.batch_id, pipe=pipe)
        pipe.execute()
        with self._idle:
            self.written += 1
            self.bytes_written += size
