"""What one GPU worker process holds across jobs: model, writer, prefetcher, leases.

rq calls ``gpu_worker.jobs.extract_batch`` in this same process (no fork), so
the model is loaded once; the job finds this object through ``WorkerRuntime.current()``.
Slot, heartbeat thread, progress log and rq set-up: hsx/fleet/role.py; the spool after a restart:
gpu_worker/spoolrecovery.py.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from gpu_worker.devices import GpuProbe
from gpu_worker.extractor import Extractor
from gpu_worker.prefetch import Prefetcher
from gpu_worker.spoolrecovery import SpoolRecovery
from gpu_worker.writer import Finished, PinnedPool, SpoolWriter
from hsx import life, runspec
from hsx.defaults import DEFAULT_PINNED_BUFFERS, DEFAULT_PREFETCH_BATCHES, DEFAULT_WRITE_QUEUE
from hsx.errors import NotPlanned
from hsx.fleet import BEFORE_RECONCILE, Chores, Role
from hsx.monitor import fmt_bytes
from hsx.runspec import Manifest, WorkerConfig

log = logging.getLogger(__name__)
FINITE = "_finite"   # the finite flag's name among the tensors _to_host copies (no stored tensor is named so)
HEARTBEATS_PER_SWEEP = 6  # beats between two sweeps of dead writers' temp files and rq workers (one heartbeat TTL)


def measures_compute(r, run: str, manifest: Manifest) -> bool:
    """A float8 run with no compute-error record yet: a starting worker may claim the measurement at its first
    plain batch (a bf16 checkpoint's linears are kept until then). Decided once a process, before the model loads."""
    return manifest.compute_dtype == "float8" and not life.Run(r, run, manifest.limits).compute_error_recorded()


class WorkerRuntime(Role):
    noun, command, jobs = "worker", "hsx worker", (life.EXTRACT_FUNC,)

    def __init__(self, cfg: WorkerConfig, r, store, manifest: Manifest, extractor: Extractor,
                 loaded_from: str | None = None, measure_compute: bool = False):
        """``measure_compute``: this process claims the float8 compute-error measurement at its first plain batch
        (``measures_compute``, decided once, before the model is loaded: ``Extractor.load`` takes it too)."""
        super().__init__(cfg, r)
        self.loaded_from = loaded_from   # the folder the weights were read from (the ready line names it)
        self.batches_run = self.tokens_run = self.tokens_computed = 0
        self.store, self.manifest, self.extractor = store, manifest, extractor
        self.run, self.worker_name = cfg.run, cfg.worker_name
        self.ledger = life.Run(r, cfg.run, manifest.limits)   # attempts and lease length: the run's, not this process's
        self.cuda = extractor.device.type == "cuda"
        self.tiers = cfg.tiers
        self.writer = SpoolWriter(self.ledger, manifest, self.tiers, cfg.host, cfg.worker_name,
                                  on_failure=self.fail_batch, depth=DEFAULT_WRITE_QUEUE)
        self.prefetcher = Prefetcher(store, cfg.run, manifest.pad_token_id, pin=self.cuda,
                                     depth=DEFAULT_PREFETCH_BATCHES, layout=extractor.batch)
        # One pinned byte buffer a batch in flight holds every stored tensor (hidden states, scales, final).
        self.pinned = (PinnedPool(DEFAULT_PINNED_BUFFERS, manifest.token_budget * manifest.host_bytes_per_token + 2**16)
                       if self.cuda else None)
        self.beats = 0
        self.copy_stream = torch.cuda.Stream(device=extractor.device) if self.cuda else None
        self.probe = GpuProbe(extractor.device.index if self.cuda else None, self._cuda_uuid() if self.cuda else None)
        self.current_batch: str | None = None
        self.measure_compute = measure_compute   # until the first plain batch, which claims the measurement
        # Shared prefixes on and not yet checked on this run: the first batch with prefix groups this process
        # runs is computed alone too (hsx/life/prefixerror.py).
        self.check_prefixes = manifest.prefix_reuse == "on" and not self.ledger.prefix_error_recorded()
        self.vanished = False                    # the run disappeared from Redis: the worker stops
        self.recovery = SpoolRecovery(self.ledger, cfg, self.tiers)

    def _record_prefix_error(self, spec, error: torch.Tensor) -> None:
        """Keep (first writer wins) and log how far the batch's shared-prefix samples are from the same alone."""
        entry = self.ledger.record_prefix_error(spec.batch_id, self.manifest.stored_layer_names, error,
                                                len(spec.prefix_groups), spec.tokens, self.worker_name)
        worst = max(entry["rel_l2"])
        if worst > life.Run.PREFIX_WARN_REL_L2:
            log.warning("shared prefixes: batch %s's samples continued from cached states differ from the same "
                        "samples alone by rel L2 %.2e (> %.0e): check the kernels (`hsx worker --kernels eager`), "
                        "or plan the run with `--prefix-reuse off`", spec.batch_id, worst, life.Run.PREFIX_WARN_REL_L2)
        else:
            log.info("shared prefixes checked on batch %s: rel L2 <= %.2e against every sample alone",
                     spec.batch_id, worst)

    def _cuda_uuid(self) -> str | None:
        try:
            return str(torch.cuda.get_device_properties(self.extractor.device).uuid)
        except (AttributeError, RuntimeError):  # older torch: fall back to CUDA_VISIBLE_DEVICES
            return None

    # ---- lifecycle (hsx/fleet/role.py calls these) -----------------------------------
    def queue_names(self) -> list[str]:
        return [self.ledger.extract_queue_name]

    def prepare(self) -> None:
        self.recovery.recover()

    def say_ready(self) -> None:
        loaded = self.loaded_from or self.manifest.model
        other = f" (the run's model: {self.manifest.model})" if loaded != self.manifest.model else ""
        log.info("ready: model %s%s loaded on %s, taking jobs from extract:%s as %s", loaded, other,
                 self.extractor.device, self.run, self.worker_name)
        log.info("forward: %s", self.extractor.kernels_line)
        log.info("shared prefixes: %s", self.extractor.prefix_line(self.manifest))
        slower = self.extractor.prefix_plan_warning(self.manifest)
        if slower:   # a warning where this worker runs the trees as planned; said where it chooses per batch
            (log.info if self.extractor.groupwise_price else log.warning)("shared prefixes: %s", slower)
        if self.extractor.device.type == "cuda":
            tight = self.extractor.wide_batch_warning(self.manifest, torch.cuda.mem_get_info(self.extractor.device)[0])
            if tight:
                log.warning("shared prefixes: %s", tight)
        why = self.cfg.memory_spool_why
        log.info("spool: %s%s", self.tiers.describe(), f" (memory tier: {why})" if why else "")

    def start(self) -> None:
        self.writer.start()
        super().start()
        self.beat()

    def close(self) -> bool:
        """Finish writing what was computed; past --grace-seconds, hand the rest back to the queue."""
        drained = self.writer.drain(self.cfg.grace_seconds)
        self.stop_heartbeat()
        if not drained:
            for bid in sorted(self.writer.held()):
                if self.ledger.hand_back(bid):
                    log.warning("handed %s back to the queue (not written within the grace period)", bid)
            log.error("writer did not drain within %.0f s; unwritten batches were handed back", self.cfg.grace_seconds)
        self.prefetcher.close()
        super().close()
        memory = next((t for t in self.tiers.tiers if t.name == runspec.MEMORY_TIER), None)
        if memory is not None:   # its empty run folder, and the default folder once empty: nothing left in /dev/shm
            runspec.remove_empty_spool_folders(memory.dir, itself=(
                Path(memory.dir).resolve() == runspec.default_memory_dir(self.cfg.redis_url).resolve()))
        return drained

    # ---- heartbeat and leases -------------------------------------------
    def totals(self) -> dict[str, int]:
        return {"batches": self.batches_run, "tokens": self.tokens_run, "computed": self.tokens_computed}

    def stats(self) -> dict:
        usage = self.tiers.usage()
        elapsed = max(time.time() - self.started, 1e-9)
        w = self.writer
        tiers = {name: {"bytes": u.bytes, "files": u.files, "temp_files": u.temp_files,
                        "budget_bytes": self.tiers.get(name).budget_bytes,
                        "write_bytes_per_s": w.rates.write_rate(name, len(w._threads))} for name, u in usage.items()}
        return {**super().stats(), "device": str(self.extractor.device), "current_batch": self.current_batch,
                "tokens_per_s": self.tokens_run / elapsed, "computed_tokens_per_s": self.tokens_computed / elapsed,
                "spooled": w.written,
                "spool_bytes": sum(u.bytes for u in usage.values()), "spool_files": sum(u.files for u in usage.values()),
                "spool_tiers": tiers, "emit_bytes_per_s": w.rates.emit_rate(),
                "bytes_written": w.bytes_written, "codec_ratio": (w.stored_bytes / w.raw_bytes) if w.raw_bytes else None,
                **self.probe.stats()}

    def refresh(self) -> None:
        """Heartbeat, leases of the batches in hand and this host's spool record: one pipeline."""
        if not self.ledger.exists():
            self.run_vanished()
            return
        current = self.current_batch
        held = self.writer.held() | ({current} if current else set())
        stats = self.stats()
        pipe = self.r.pipeline(transaction=False)
        self.publish_heartbeat(stats, pipe=pipe)
        self.ledger.refresh_extract_leases(held, pipe=pipe)
        self.ledger.publish_host(self.cfg.host, {
            "spool_bytes": stats["spool_bytes"], "spool_files": stats["spool_files"],
            "spool_budget_bytes": sum(t.budget_bytes for t in self.tiers.tiers),
            "spool_tiers": stats["spool_tiers"]}, pipe=pipe)
        pipe.execute()
        self.beats += 1

    def kept_runs(self) -> list[Chores]:
        """This worker's run (none once it vanished); every HEARTBEATS_PER_SWEEP-th beat, dead writers' temp files
        and rq workers go too, before the reconcile pass."""
        if self.vanished:
            return []
        if self.beats % HEARTBEATS_PER_SWEEP:
            return [Chores(self.ledger)]
        return [Chores(self.ledger, clean_rq=BEFORE_RECONCILE, tidy=self.recovery.sweep_temp_files)]

    def run_vanished(self) -> None:
        """The run's manifest is gone from a reachable Redis (restarted empty, flushed): stop, do not spin.

        Batch files already spooled stay on disk; after `hsx produce` rebuilds the ledger from the store,
        a restarted worker re-enqueues their uploads (``SpoolRecovery.recover``).
        """
        if self.vanished:
            return
        self.vanished = True
        log.error("run %r is no longer in Redis (restarted empty or flushed?): this worker stops. Re-run "
                  "`hsx produce` for the run (it rebuilds the ledger from the store), then restart the workers; "
                  "spooled files are kept and uploaded after the restart", self.run)
        self._stop.set()
        self.stop_serving()

    # ---- progress log ------------------------------------------------------
    def progress_line(self) -> str:
        """Totals, rates, spool and queue: one line a person can follow for hours."""
        elapsed = max(time.time() - self.started, 1e-9)
        usage = self.tiers.usage()
        files, nbytes = sum(u.files for u in usage.values()), sum(u.bytes for u in usage.values())
        queued = self.queue_length(self.ledger.extract_queue_name)
        grown, interval = self.since_last_line()
        tokens, batches = grown["tokens"], grown["batches"]
        return (f"worker {self.worker_name}: {self.batches_run} batches, {self.tokens_run} tokens in {elapsed:.0f}s; "
                f"last {interval:.0f}s: {tokens / interval:.0f} tokens/s, {60 * batches / interval:.1f} batches/min; "
                f"{self.writer.written} spooled ({fmt_bytes(self.writer.bytes_written)}); spool {files} files {fmt_bytes(nbytes)} of "
                f"{fmt_bytes(sum(t.budget_bytes for t in self.tiers.tiers))} ({', '.join(t.name for t in self.tiers.tiers)}); "
                f"extract:{self.run} queue {queued}")

    def finished(self) -> bool:
        if self.cfg.exit_when_complete and self.ledger.complete():
            log.info("run %s complete: worker %s exits (--exit-when-complete)", self.run, self.worker_name)
            return True
        return False

    def idle_line(self) -> str | None:
        """Idle because the run is complete: said once instead of a progress line every interval."""
        try:
            complete = self.ledger.complete()
        except Exception:  # Redis away: the progress line says so
            return None
        return f"run {self.run} complete, idle: worker {self.worker_name} waits for jobs on extract:{self.run}" if complete else None

    def spool_full(self) -> bool:
        """Every spool tier at its budget (memory and disk), or its file system without room for a batch
        as large as the largest so far: take no job until uploads free some."""
        return self.tiers.full(self.writer.largest_raw)

    # ---- the job ---------------------------------------------------------
    def extract(self, bid: str) -> str:
        try:
            spec = self.ledger.lease(bid)  # one script: done?, spec, lease
        except life.IllegalTransition:
            return f"{bid} already done"
        if spec is None:
            if not self.ledger.exists():
                self.run_vanished()
                return f"{bid}: run {self.run} vanished from Redis; not extracted"
            raise NotPlanned(f"batch {bid} is not in the plan of run {self.run}")
        self.current_batch = bid
        self.ledger.publish_current(self.worker_name, bid)  # now, not at the next beat
        try:
            batch, contents = self.prefetcher.take(spec)
            self._hint_next()
            fed_before = self.extractor.tokens_fed
            hidden, final, compute_error, reference = self._forward(spec, batch, contents)
            measure = self.batches_run % life.Run.ERROR_SAMPLE_EVERY == 0
            stored = self.extractor.stored(hidden, final, measure_error=measure)
            if compute_error is not None:
                stored["compute_error"] = compute_error
            finite = torch.isfinite(hidden).all()
            if final is not None:
                finite = finite & torch.isfinite(final).all()
            item = self._to_host(spec, contents, stored, finite, reference)
            self.writer.submit(item, emitted_bytes=sum(t.numel() * t.element_size() for t in stored.values()))
        except BaseException:
            self.ledger.release(bid)  # fail (the job's failure handler) counts it, if it runs
            raise
        finally:
            self.current_batch = None
        self.batches_run += 1
        self.tokens_run += spec.tokens
        # what the batch's forwards computed (a packed row: its real tokens; a tree batch in waves: each piece once;
        # a process's first float8 or prefix batch: its check's extra forward too)
        self.tokens_computed += self.extractor.tokens_fed - fed_before
        self.after_batch()
        return f"{bid}: {spec.samples} samples, {spec.tokens} tokens"

    def _forward(self, spec, batch, contents) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, str | None]:
        """The batch's forward: (hidden, final, compute error or None, its reference or None).

        Once a process, on its first plain batch, a float8 run's worker that wins the claim runs one extra forward
        (the compute error); the first batch with prefix groups is checked against its samples computed alone."""
        if self.measure_compute and not spec.prefix_groups:
            self.measure_compute = False
            if self.ledger.claim_compute_error(self.worker_name):
                return self.extractor.run_measured(batch)
        if spec.prefix_groups and self.check_prefixes:
            self.check_prefixes = False
            hidden, final, error = self.extractor.run_shared_checked(
                contents.input_ids, contents.cu_seqlens, spec.prefix_groups, self.manifest.token_budget,
                self.manifest.prefix_cache_tokens, self.manifest.forward_tokens, self.manifest.pad_token_id)
            self._record_prefix_error(spec, error)
        elif spec.prefix_groups:
            hidden, final = self.extractor.run_shared(contents.input_ids, contents.cu_seqlens, spec.prefix_groups,
                                                      self.manifest.token_budget, self.manifest.prefix_cache_tokens,
                                                      self.manifest.forward_tokens)
        else:
            hidden, final = self.extractor.run(batch)
        return hidden, final, None, None

    def _hint_next(self) -> None:
        """Start fetching the inputs of the next jobs in the queue (two Redis round trips)."""
        q = self.ledger.extract_queue()
        bids = [p[1] for p in map(life.batch_of_job, q.get_job_ids(0, self.prefetcher.depth - 1)) if p]
        bids = [bid for bid in bids if not self.prefetcher.cached(bid)]
        if bids:
            self.prefetcher.hint(self.ledger.specs(bids))

    def _to_host(self, spec, contents, stored: dict, finite, reference: str | None) -> Finished:
        """Copy the stored tensors and the finite flag to one pinned buffer on the side stream; the writer waits
        on the event. Every tensor read there is marked as used by it (``record_stream``), or its block goes back
        to the compute stream's pool when extract() returns and the next forward overwrites it before the copy:
        the flag once was not, and 2 of 8 batches of the 8B fused pipeline read a stray byte as "NaN/Inf" on an
        H100 (a stray non-zero would have passed a batch holding NaN)."""
        if not self.cuda:
            return Finished.of(spec, contents, stored, finite, None, lambda: None, reference)
        tensors = {**stored, FINITE: finite}
        buf = self.pinned.get(sum(_aligned(t.numel() * t.element_size()) for t in tensors.values()))
        stream = self.copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.extractor.device))
        host, offset = {}, 0
        with torch.cuda.stream(stream):
            for name, t in tensors.items():
                nbytes = t.numel() * t.element_size()
                view = buf[offset:offset + nbytes].view(t.dtype).view(t.shape)
                view.copy_(t, non_blocking=True)
                t.record_stream(stream)
                host[name] = view
                offset += _aligned(nbytes)
            event = torch.cuda.Event()
            event.record(stream)
        host_finite = host.pop(FINITE)
        return Finished.of(spec, contents, host, host_finite, event, lambda: self.pinned.put(buf), reference)

    # ---- failures --------------------------------------------------------
    def fail_batch(self, bid: str, error: str) -> None:
        """Count a failure: extracted again, or a dead letter at the run's max_attempts (nothing if done)."""
        self.ledger.release(bid)
        self.ledger.fail(bid, error)


def _aligned(nbytes: int) -> int:
    """Bytes a tensor takes in a pinned buffer: every tensor starts 64-byte aligned."""
    return -(-nbytes // 64) * 64
