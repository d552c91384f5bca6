"""`hsx worker`: an rq SimpleWorker (no fork: the model stays loaded) on the run's extract queue."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from rq.exceptions import AbandonedJobError

from gpu_worker.extractor import Extractor
from gpu_worker.fp8compute import require_fp8_device
from gpu_worker.runtime import WorkerRuntime, measures_compute
from hsx import life, retry, runspec
from hsx.errors import HsxError
from hsx.fleet import RqWorker, check_eviction_policy
from hsx.life import RunVanished
from hsx.localdirs import ensure_dir
from hsx.prep import fingerprint_cached, local_folder, weights_fingerprint
from hsx.redisconn import AWAY_ERRORS, connect, redact
from hsx.runspec import RunNotVisible, WorkerConfig
from hsx.store import layout

log = logging.getLogger(__name__)
PLAN_POLL_SECONDS = 5  # --wait-for-plan: seconds between looks for the run's manifest


class WorkerSetupError(HsxError, RuntimeError):
    """The worker cannot start; the message says why."""


class RunAlreadyComplete(Exception):
    """--exit-when-complete and the run is complete at start: nothing to load, nothing to do."""


class ExtractWorker(RqWorker):
    """Takes a job only while the host spool is under its byte budget (backpressure, never failure)."""

    def before_dequeue(self) -> None:
        rt = WorkerRuntime.installed()
        waited = False
        while rt is not None and rt.spool_full() and not self.stop_requested:
            if not waited:
                log.warning("spool full (%s): waiting for uploads before taking a job", rt.tiers.describe())
                waited = True
            self.heartbeat()
            retry.pause(1.0)
        if waited:
            log.warning("spool has room again: taking jobs")


def _on_failure(job, exc_type, exc_value, tb):
    if exc_type is AbandonedJobError:
        return True  # rq's sweep of a dead worker's job: leases or the reconciler already re-enqueued the batch
    parsed = life.batch_of_job(job.id)
    rt = WorkerRuntime.installed()
    lost = store_lost(rt, parsed[1], exc_type, exc_value) if parsed and rt is not None else None
    if lost is not None:
        # Inputs missing because the store itself is gone from this host (an unmounted share): no batch is at
        # fault. Hand it back uncounted and take no more jobs, rather than dead-letter the run batch by batch.
        rt.ledger.hand_back(parsed[1], leased=False)  # the job let go of its lease already
        log.error("%s", lost)
        rt.refuse(RunNotVisible(lost))
        return True
    if parsed and rt is not None and retry.STOP.is_set():
        # Stopping: the waits of the job in hand ended at once (a store or Redis away), not its batch's fault.
        try:
            rt.ledger.hand_back(parsed[1], leased=False)  # the job let go of its lease already
            log.warning("handed %s back to the queue: stopping (%s: %s), no failure counted", parsed[1],
                        exc_type.__name__, str(exc_value).splitlines()[0][:200] if str(exc_value) else "")
        except AWAY_ERRORS:  # Redis away too: its lease brings it back
            pass
        return True
    if parsed and rt is not None:
        rt.fail_batch(parsed[1], f"{exc_type.__name__}: {exc_value}")
    return True


def store_lost(rt: WorkerRuntime, bid: str, exc_type, exc_value) -> str | None:
    """Why this worker must take no more jobs, when batch ``bid``'s inputs are missing because the run's store
    itself is gone from this host (its manifest is not there either); None otherwise."""
    if exc_type is not FileNotFoundError:
        return None
    try:
        if rt.store.head(layout.manifest_key(rt.run)) is not None:
            return None
    except Exception:  # the store answers with errors: not this rule's case, count the failure as usual
        return None
    return (f"this worker cannot see the run's store {rt.store.url()} from host {rt.cfg.host} any more (reading "
            f"inputs of {bid}: {exc_value}): mount it at that path or use S3, then restart the worker; the batch was "
            "handed back, no failure counted")


def check_device(device: str) -> None:
    """A device this torch can use, else WorkerSetupError saying why and what to pass instead."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise WorkerSetupError(f"--device {device}: not a torch device ({exc}); use cpu or cuda:N") from None
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        why = ("this torch is built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA GPU (driver missing, or CUDA_VISIBLE_DEVICES hides them)")
        raise WorkerSetupError(f"{device} asked (--gpu / --device), but {why}; use --device cpu to run on the CPU, "
                               "or install a CUDA build of torch on a GPU machine")
    count = torch.cuda.device_count()
    if (dev.index or 0) >= count:
        raise WorkerSetupError(f"{device} asked, but torch sees {count} CUDA device(s): use --gpu 0..{count - 1}")


def check_directories(cfg: WorkerConfig, model: str | None) -> None:
    """Every directory this worker writes, before it takes a job (a wrong owner would dead-letter the run)."""
    ensure_dir(cfg.spool_dir, "spool", "--spool-dir / HSX_SPOOL_DIR")
    if cfg.memory_spool_dir is not None and cfg.memory_spool_budget_bytes > 0:
        ensure_dir(cfg.memory_spool_dir, "memory spool", "--memory-spool-dir / HSX_MEMORY_SPOOL_DIR")
    hf_home = os.environ.get("HF_HOME")
    if model is not None and not Path(model).exists() and hf_home:  # a hub id: downloaded into HF_HOME
        ensure_dir(Path(hf_home), "model cache", "HF_HOME")


def load_runtime(cfg: WorkerConfig) -> WorkerRuntime:
    check_device(cfg.device)
    check_directories(cfg, None)
    r = connect(cfg.redis_url, ride_out=True)
    check_eviction_policy(r, f"Redis at {redact(cfg.redis_url)}")
    run = life.Run(r, cfg.run)
    manifest = run.manifest()
    if manifest is None and cfg.wait_for_plan:
        log.info("run %r is not planned yet; waiting for `hsx produce` (checking every %d s)", cfg.run, PLAN_POLL_SECONDS)
        while manifest is None:
            time.sleep(PLAN_POLL_SECONDS)
            manifest = run.manifest()
    if manifest is None:
        manifest = run.require_manifest()
    if cfg.exit_when_complete and run.complete():
        raise RunAlreadyComplete(cfg.run)
    lease = manifest.limits.lease_seconds
    if cfg.heartbeat_seconds * 2 > lease:
        raise WorkerSetupError(f"--heartbeat-seconds {cfg.heartbeat_seconds:g} must be at most half of run "
                               f"{cfg.run!r}'s lease ({lease} s, set by hsx produce --lease-seconds), or leases expire "
                               "between beats and batches run twice")
    if manifest.compute_dtype == "float8":
        require_fp8_device(cfg.device)  # before the model is read: a CPU or pre-Ada GPU is refused at once
    model_path = cfg.model_override or manifest.model
    check_directories(cfg, model_path)  # HF_HOME writable before the config of a hub id is fetched into it
    try:
        store = runspec.check_host(manifest, model_path, "worker", cfg.host)
    except runspec.ModelMismatch as exc:
        raise WorkerSetupError(str(exc)) from None
    folder = local_folder(model_path)
    if folder is not None and fingerprint_cached(model_path):   # no read needed: refused before a long load
        manifest = check_run_weights(run, store, manifest, str(folder.resolve()), cfg)
    log.info("loading %s on %s (layers %s)", model_path, cfg.device, list(manifest.layer_ids))
    measure = measures_compute(r, cfg.run, manifest)
    extractor = Extractor.load(model_path, list(manifest.layer_ids), manifest.store_final, cfg.device, manifest.dtype,
                               store_dtype=manifest.store_dtype, compute_dtype=manifest.compute_dtype,
                               fp8_accumulation=manifest.fp8_accumulation, kernels=cfg.kernels, measure_compute=measure)
    extractor.groupwise_price = cfg.prefix_forward_tokens
    folder = local_folder(model_path)   # after the load: a hub id's snapshot is on this host now
    loaded = str(folder.resolve()) if folder is not None else model_path
    manifest = check_run_weights(run, store, manifest, loaded, cfg)
    return WorkerRuntime(cfg, r, store, manifest, extractor, loaded_from=loaded, measure_compute=measure)


def check_run_weights(run: life.Run, store, manifest, loaded: str, cfg: WorkerConfig):
    """The weights in folder ``loaded`` are the run's (hsx.runspec.check_weights): after the load, read from the
    page cache it filled, and before it too where the fingerprint's cache is current (nothing to read). The first
    worker of a run whose manifest has no fingerprint in this hsx's scheme records its own (a manifest with none
    takes it, in Redis and the store). Returns the manifest, with the fingerprint it took."""
    taken = []

    def record(fingerprint: str) -> dict:
        held = run.record_weights(fingerprint, loaded, cfg.worker_name, cfg.host, manifest)
        if held["fingerprint"] == fingerprint and held.get("worker") == cfg.worker_name:
            log.info("run %s: recorded its weights fingerprint %s (%s), the first worker to load them", cfg.run,
                     fingerprint, loaded)
            with_it = replace(manifest, model_weights=fingerprint)
            if not manifest.model_weights and run.manifest() == with_it:  # Redis' manifest took it
                with_it.save(store)   # the store's manifest.json holds it too
                taken.append(with_it)
        return held

    try:
        runspec.check_weights(manifest, loaded, weights_fingerprint, record)
    except (runspec.ModelMismatch, HsxError) as exc:
        raise WorkerSetupError(str(exc)) from None
    return taken[0] if taken else manifest


def run_worker(cfg: WorkerConfig, rt: WorkerRuntime | None = None) -> WorkerRuntime | None:
    """Serve until stopped; None when --exit-when-complete found the run complete before the model loaded."""
    try:
        rt = rt or load_runtime(cfg)
    except RunAlreadyComplete:
        log.info("run %s is complete: nothing to do (--exit-when-complete)", cfg.run)
        return None
    rt.serve(ExtractWorker, exception_handlers=(_on_failure,))  # raises RunNotVisible when the store was lost
    if rt.vanished:
        raise RunVanished(f"run {cfg.run!r} vanished from Redis at {redact(cfg.redis_url)} while this worker ran "
                          "(restarted empty or flushed?): re-run `hsx produce` for it (the ledger is rebuilt from the "
                          "store, nothing verified is recomputed), then restart the workers")
    return rt

