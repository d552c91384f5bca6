"""The writer threads: device -> pinned host memory -> spool file (memory tier first) -> upload job.

The GPU thread hands over a finished batch and goes on at once. The copy to
host runs on a side CUDA stream into a reused pinned buffer; a writer thread
waits for it, validates, compresses (the run's codec), writes the file
atomically into the first spool tier with room (memory, then disk; it waits
while both are full), and enqueues the upload (which names the tier) in one
Redis pipeline with dropping the batch's lease. The queue is bounded (the GPU
thread blocks only if the spool is slower than the GPU).

Each write is timed: ``rates`` compares the bytes/s the GPU emits with what
each tier sustains, and a warning with both numbers and the fix is logged
when the disk tier cannot keep up.
"""

from __future__ import annotations

import logging
import queue as stdqueue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hsx import life, retry, runspec
from hsx.batch import BatchContents, BatchFileError, BatchMeta, validate_batch, write_atomic
from hsx.life import BatchSpec
from hsx.redisconn import AWAY_ERRORS
from hsx.runspec import Manifest

log = logging.getLogger(__name__)
# Writer threads: one file is written and hashed while the other is fsynced, so
# one slow fsync does not hold the GPU thread (measured in bench/gpu_bench.py).
WRITER_THREADS = 2
TIER_WAIT_SECONDS = 0.05   # poll period while every spool tier is full
DISK_FULL_WAIT_SECONDS = 0.5  # pause before a write that met ENOSPC is tried again
RATE_WARN_SECONDS = 60.0   # at most one "disk cannot keep up" warning a minute


class Stopping(Exception):
    """A write given up because this process stops (a wait for spool room ended by hsx.retry.STOP)."""


@dataclass(frozen=True)
class Finished:
    """A computed batch handed from the GPU thread to a writer: what is stored, and what is only measured.

    ``tensors`` are the batch file's (hidden_states, hidden_scales, final_hidden_states, final_scales as
    stored); the two measurements have fields of their own and never reach the file. The worker's runtime
    builds one from the extractor's dict, where they sit under ``MEASURED`` keys (``Finished.of``).
    """

    spec: BatchSpec
    contents: BatchContents
    tensors: dict[str, torch.Tensor]   # on the host (pinned views, or CPU tensors): what the batch file stores
    finite: torch.Tensor               # 0-dim bool on the host
    ready: object | None               # torch.cuda.Event to wait on, or None
    release: Callable[[], None]        # give the pinned buffer back
    compute_reference: str | None = None  # what compute_error compares against (hsx/life/computeerror.py)
    fp8_error: torch.Tensor | None = None      # [2, n] storage error of this batch, if sampled (ERROR_SAMPLE_EVERY)
    compute_error: torch.Tensor | None = None  # [2, n] on the batch the run's FP8 compute error is measured on

    @classmethod
    def of(cls, spec: BatchSpec, contents: BatchContents, host: dict[str, torch.Tensor], finite: torch.Tensor,
           ready: object | None, release: Callable[[], None], compute_reference: str | None) -> Finished:
        """One from the extractor's dict as copied to the host: the ``MEASURED`` keys become their fields."""
        return cls(spec, contents, {name: t for name, t in host.items() if name not in MEASURED}, finite, ready,
                   release, compute_reference, fp8_error=host.get("fp8_error"), compute_error=host.get("compute_error"))


MEASURED = ("fp8_error", "compute_error")   # keys of the extractor's dict that are measurements, not stored


class PinnedPool:
    """Reused pinned host buffers (bytes), so host memory stays flat over a long run. A batch that needs more than
    a buffer (a batch of shared-prefix trees storing more than a token budget: --prefix-stored-budgets) gets one
    of its own, dropped when given back (torch's caching host allocator keeps it for the next such batch)."""

    def __init__(self, count: int, nbytes: int):
        self._free: stdqueue.Queue = stdqueue.Queue()
        for _ in range(count):
            self._free.put(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        self.nbytes, self.count = nbytes, count

    def get(self, nbytes: int = 0) -> torch.Tensor:
        if nbytes > self.nbytes:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._free.get()

    def put(self, buf: torch.Tensor) -> None:
        if buf.numel() == self.nbytes:   # one of the pool's (a larger one of its own is dropped)
            self._free.put(buf)


class SpoolWriter:
    def __init__(self, ledger: life.Run, manifest: Manifest, tiers: runspec.SpoolTiers, host: str, worker_name: str,
                 on_failure: Callable[[str, str], None], depth: int, fsync: bool = True):
        self.ledger, self.r, self.run, self.manifest = ledger, ledger.r, ledger.name, manifest
        self.tiers, self.host, self.worker_name = tiers, host, worker_name
        self.codec = manifest.codec
        self.on_failure, self.fsync = on_failure, fsync
        self._q: stdqueue.Queue = stdqueue.Queue(maxsize=depth)
        self._threads = [threading.Thread(target=self._loop, name=f"hsx-writer-{i}", daemon=True)
                         for i in range(WRITER_THREADS)]
        self.written = 0          # batches spooled by this process
        self.bytes_written = 0
        self.in_flight: set[str] = set()
        self._idle = threading.Condition()
        self.rates = WriteRates()
        self.raw_bytes = 0        # hidden-state bytes before the codec (for the measured ratio)
        self.stored_bytes = 0     # the same after it
        self.largest_raw = 0      # bytes of the largest batch so far (uncompressed): a full tier cannot take it
        self.disk_full_waits = 0  # writes that met ENOSPC and waited for room (never counted as failures)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, item: Finished, emitted_bytes: int = 0) -> None:
        with self._idle:
            self.in_flight.add(item.spec.batch_id)
        self.rates.emitted(emitted_bytes)
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
                if retry.STOP.is_set():  # stopping: its waits ended (Redis or the spool), not the batch's fault
                    self._hand_back(item.spec.batch_id, exc)
                    continue
                log.error("batch %s failed at write: %s", item.spec.batch_id, exc)
                self.on_failure(item.spec.batch_id, f"write: {type(exc).__name__}: {exc}")
            finally:
                item.release()
                with self._idle:
                    self.in_flight.discard(item.spec.batch_id)
                    self._idle.notify_all()

    def _hand_back(self, bid: str, exc: Exception) -> None:
        """A batch not written because this process stops: queued again, no failure counted (with Redis away,
        its lease brings it back)."""
        try:
            if self.ledger.hand_back(bid):
                log.warning("handed %s back to the queue: stopping before it was written (%s)", bid, exc)
        except AWAY_ERRORS:
            pass

    def _write(self, item: Finished) -> None:
        spec, contents = item.spec, item.contents
        if item.ready is not None:
            item.ready.synchronize()  # also before a skip: the pinned buffer is reused once released
        error, compute_error = item.fp8_error, item.compute_error
        if self.ledger.release_if_done(spec.batch_id):  # a duplicate delivery finished elsewhere first
            if compute_error is not None:  # measured all the same: the run's record, if it has none yet
                self.ledger.record_compute_error(spec.batch_id, self.manifest, compute_error, spec.tokens,
                                                 item.compute_reference or "", self.worker_name)
            return
        tensors = {**item.tensors, "input_ids": contents.input_ids.to(torch.int32),
                   "loss_mask": contents.loss_mask.to(torch.uint8), "cu_seqlens": contents.cu_seqlens.to(torch.int64)}
        if not bool(item.finite):
            raise BatchFileError("hidden states hold NaN/Inf (found on the GPU, before storing)")
        validate_batch(tensors, contents.sample_ids, check_finite=False)   # checked against the plan on reading
        m = self.manifest
        metadata = BatchMeta(run=self.run, batch_id=spec.batch_id, sample_ids=tuple(contents.sample_ids),
                             layer_ids=tuple(m.layer_ids), dtype=m.dtype, store_dtype=m.store_dtype, codec=m.codec,
                             model=m.model, hidden_size=m.hidden_size, store_final=m.store_final,
                             incarnation=m.incarnation).to_metadata()   # incarnation: hsx/life/provenance.py
        raw = sum(t.numel() * t.element_size() for t in tensors.values())
        self.largest_raw = max(self.largest_raw, raw)
        tier, path, size, sha, started = self._write_file(spec.batch_id, raw, tensors, metadata)
        self.rates.wrote(tier.name, size, time.monotonic() - started)
        self._warn_if_slow()
        pipe = self.r.pipeline()
        self.ledger.spool(spec.batch_id, self.host, str(path), size, sha, tier.name, pipe)
        if error is not None:
            self.ledger.record_store_error(spec.batch_id, m, error, spec.tokens, pipe=pipe)
        if compute_error is not None:
            entry = self.ledger.record_compute_error(spec.batch_id, m, compute_error, spec.tokens,
                                                     item.compute_reference or "", self.worker_name, pipe=pipe)
        pipe.execute()
        if compute_error is not None:
            log.info("float8 compute error measured on %s (%d tokens), rel L2 / cosine per stored layer against %s: "
                     "%s", spec.batch_id, spec.tokens, entry["reference"],
                     ", ".join(f"{layer} {rel:.4f}/{cos:.5f}" for layer, rel, cos
                               in zip(entry["layer_ids"], entry["rel_l2"], entry["cosine"], strict=True)))
        with self._idle:
            self.written += 1
            self.bytes_written += size
            self.raw_bytes += raw
            self.stored_bytes += size

    def _write_file(self, bid: str, raw: int, tensors: dict, metadata: dict):
        """Write the batch file into the first tier with room: (tier, path, size, sha256, start time).

        A full file system is backpressure, not a failure: a write that meets ENOSPC (the temp
        file is removed by write_atomic) waits for room and is tried again, never counted
        against the batch. Another OSError of the memory tier falls back to the disk tier once.
        """
        fallback = False
        while True:
            tier = self.tiers.get(runspec.DISK_TIER) if fallback else self._take_tier(raw)
            path = self.tiers.path(tier.name, self.run, bid)
            started = time.monotonic()
            try:
                # A temp file of this write's own: a duplicate of the batch in the other thread never shares it.
                size, sha = write_atomic(path, tensors, metadata, fsync=self.fsync,
                                         tmp_tag=runspec.spool_temp_tag(self.worker_name), codec=self.codec)
                return tier, path, size, sha, started
            except OSError as exc:
                if runspec.is_disk_full(exc):
                    if not self.disk_full_waits:
                        log.warning("spool file system full writing %s to the %s tier (%s); waiting for uploads to "
                                    "free room, the batch is kept (not a failure)", bid, tier.name, exc)
                    self.disk_full_waits += 1
                    fallback = False
                    if retry.pause(DISK_FULL_WAIT_SECONDS):
                        raise Stopping(f"stopping while the spool's file system was full ({exc})") from None
                    continue
                if tier.name != runspec.MEMORY_TIER or len(self.tiers.tiers) < 2 or fallback:
                    raise
                log.warning("memory tier write of %s failed (%s); writing it to the disk tier", bid, exc)
                fallback = True

    def _take_tier(self, nbytes: int) -> runspec.Tier:
        """The first tier with room; while every tier is full, wait (the GPU thread goes on until the queue fills)."""
        waited = False
        while (tier := self.tiers.choose(nbytes)) is None:
            if not waited:
                log.warning("no spool tier has room for %d bytes (%s); waiting for uploads", nbytes, self.tiers.describe())
                waited = True
            if retry.pause(TIER_WAIT_SECONDS):
                raise Stopping("stopping while no spool tier had room")
        return tier

    def _warn_if_slow(self) -> None:
        advice = self.rates.advice(len(self._threads))
        if advice:
            log.warning(advice)


class WriteRates:
    """The GPU's emit rate against each spool tier's sustained write rate (bytes/s), for the warning."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = None
        self.emitted_bytes = 0
        self.tier_bytes: dict[str, int] = {}
        self.tier_seconds: dict[str, float] = {}
        self._warned = -RATE_WARN_SECONDS

    def emitted(self, nbytes: int) -> None:
        with self._lock:
            if self.started is None:
                self.started = time.monotonic()
            self.emitted_bytes += nbytes

    def wrote(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.tier_bytes[tier] = self.tier_bytes.get(tier, 0) + nbytes
            self.tier_seconds[tier] = self.tier_seconds.get(tier, 0.0) + seconds

    def emit_rate(self) -> float:
        elapsed = time.monotonic() - self.started if self.started else 0.0
        return self.emitted_bytes / elapsed if elapsed > 1.0 else 0.0

    def write_rate(self, tier: str, threads: int) -> float:
        """Bytes/s the tier sustains with ``threads`` writers (each write's own time, threads in parallel)."""
        seconds = self.tier_seconds.get(tier, 0.0)
        return threads * self.tier_bytes.get(tier, 0) / seconds if seconds else 0.0

    def advice(self, threads: int) -> str | None:
        """A warning when the disk tier writes slower than the GPU emits (at most once a RATE_WARN_SECONDS)."""
        now = time.monotonic()
        if now - self._warned < RATE_WARN_SECONDS or self.tier_bytes.get(runspec.DISK_TIER, 0) < 2**28:
            return None
        emit, disk = self.emit_rate(), self.write_rate(runspec.DISK_TIER, threads)
        if not emit or not disk or disk >= emit:
            return None
        self._warned = now
        return (f"the spool's disk tier writes {disk / 2**30:.2f} GiB/s, the GPU emits {emit / 2**30:.2f} GiB/s: "
                "the disk cannot keep up and the GPU will wait. Fix: a larger memory tier "
                "(--memory-spool-budget-gb), a faster disk for --spool-dir, or fewer bytes "
                "(--store-dtype float8_e4m3, --codec zstd), or more uploaders on this host")
