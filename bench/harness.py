"""The parts of the benchmark that are not the model: services, data, timing, one pipeline run.

One process holds one model and one private redis-server; each measured
configuration is its own run (plan -> queue -> worker -> spool -> uploaders ->
local-directory store). Uploaders are real ``hsx upload`` processes.

Timing. On a GPU every forward is bracketed by CUDA events on the compute
stream; "useful tokens/s" is real (unpadded) tokens over the event time from
the end of the last warm-up batch to the end of the last batch, so the
pipeline and the bare forward are measured the same way, and any gap where
the GPU waited for the host (rq, Redis, prefetch, a full writer queue) counts
against the pipeline. "GPU busy" is the time inside forwards over that span.
On the CPU the same marks are host clock readings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_worker.extractor import Extractor  # noqa: E402
from hsx.defaults import DEFAULT_FP8_ACCUMULATION  # noqa: E402
from hsx.life import ledger  # noqa: E402
from hsx.life.keys import RunKeys  # noqa: E402
from hsx.runspec import spool  # noqa: E402
from hsx.runspec.config import ProduceConfig, StoreSettings, WorkerConfig  # noqa: E402

GiB = 2**30


def make(cls, **values):
    """A frozen config from ``values``; fields the caller does not know keep their defaults."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names})


# ---- timing -------------------------------------------------------------
class Clock:
    """CUDA events on the compute stream on a GPU; host clock readings on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def summarise(marks: list[tuple], clock: Clock, warm: int) -> dict:
    """marks: (start, end, real tokens, computed tokens) per batch, in order. Skips ``warm`` batches."""
    warm = min(warm, max(len(marks) - 2, 0))
    window = marks[warm:]
    begin = marks[warm - 1][1] if warm else marks[0][0]
    span = clock.seconds(begin, window[-1][1])
    busy = sum(clock.seconds(s, e) for s, e, *_ in window)
    real = sum(m[2] for m in window)
    computed = sum(m[3] for m in window)
    return {"batches": len(window), "tokens": real, "seconds": span, "tok_s": real / span,
            "computed_tok_s": computed / span, "busy": busy / span, "padding": 1 - real / computed}


class TimedExtractor(Extractor):
    """The worker's Extractor with a clock mark around each forward (its hooks capture nothing in bare forwards)."""

    marks: list

    def run(self, batch, **kw):
        start = self.clock.mark()
        result = super().run(batch, **kw)
        self.marks.append((start, self.clock.mark(), batch.n_tokens, batch.input_ids.numel()))
        return result

    def run_measured(self, batch):
        """The compute-error batch (once a float8 run: its reference forward, then the stored one) as one mark,
        so that the batch is counted once in the window; its passes' time beyond the stored forward is kept in
        ``measured_extra`` (seconds, summed once the clock is synced)."""
        before = len(self.marks)
        result = super().run_measured(batch)
        passes = self.marks[before:]
        del self.marks[before:]
        self.marks.append((passes[0][0], passes[-1][1], batch.n_tokens, batch.input_ids.numel()))
        self.measured_extra.append(passes[:-1])
        return result


def timed_extractor(model, layer_ids, store_final, out_dtype, clock, kernels: str = "auto") -> TimedExtractor:
    ex = TimedExtractor(model, layer_ids, store_final, out_dtype, kernels=kernels)
    ex.clock, ex.marks, ex.measured_extra = clock, [], []
    return ex


@torch.inference_mode()
def bare_forward(decoder, layers, shapes, vocab: int, device, clock: Clock, warm: int, packed=None) -> dict:
    """Same padded batches through ``layers`` (no capture, no I/O); shapes: (rows, padded_len, real).
    ``packed``: (extractor, [cu_seqlens of each batch]) where the extractor packs rows: the same batches laid out
    as its worker lays them out (``Extractor.batch``: a packed row where a batch pads enough, else padded; random
    ids, the plan's sample bounds), through its forward without capture."""
    from gpu_worker.extractor import PackedBatch

    saved, decoder.layers = decoder.layers, layers
    try:
        gen = torch.Generator().manual_seed(0)
        if packed:
            extractor, bounds = packed
            inputs = [extractor.batch(torch.randint(0, vocab, (int(cu[-1]),), generator=gen), cu, length, 0, clock.cuda)
                      for cu, (_, length, _) in zip(bounds, shapes, strict=True)]

            def forward(batch):
                if isinstance(batch, PackedBatch):
                    return extractor.forward_rows(batch, capture=False)
                return _plain(decoder, batch.input_ids.to(device))
            key = lambda batch: batch.input_ids.shape  # noqa: E731  (fla compiles per shape, as the worker meets them)
        else:
            inputs = [torch.randint(0, vocab, (rows, length), generator=gen).to(device) for rows, length, _ in shapes]
            forward = functools.partial(_plain, decoder)
            key = lambda ids: ids.shape  # noqa: E731
        seen = set()
        for batch in inputs:  # every batch shape once: fla's Triton kernels compile per shape, off the clock
            if key(batch) not in seen:
                seen.add(key(batch))
                forward(batch)
        clock.sync()
        if clock.cuda:
            torch.cuda.reset_peak_memory_stats()
        marks = []
        for batch, (rows, length, real) in zip(inputs, shapes, strict=False):
            start = clock.mark()
            forward(batch)
            marks.append((start, clock.mark(), real, batch.input_ids.numel() if packed else rows * length))
        clock.sync()
    finally:
        decoder.layers = saved
    out = summarise(marks, clock, warm)
    out["layers"] = len(layers)
    out["peak_gib"] = torch.cuda.max_memory_allocated() / GiB if clock.cuda else None
    return out


def _plain(decoder, ids):
    return decoder(input_ids=ids, use_cache=False)


def plan_bounds(svc, run: str, specs) -> list[torch.Tensor]:
    """Each planned batch's ``cu_seqlens`` as the producer wrote its inputs to the store."""
    from hsx.batch import read_batch_bytes
    from hsx.store import layout

    store = StoreSettings(url=svc.store_url).open()
    return [read_batch_bytes(store.get_bytes(layout.input_key(run, s.shard, s.batch_id))).cu_seqlens for s in specs]


# ---- data ---------------------------------------------------------------
def lengths_lognormal(n: int, seed: int = 0, median: float = 600, sigma: float = 0.88, cap: int = 4096,
                      floor: int = 16) -> np.ndarray:
    """The realistic mix: lognormal, median ~600, mean ~880, capped at 4096 tokens."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(math.log(median), sigma, n).astype(np.int64), floor, cap)


def lengths_for(kind: str, total_tokens: int, seed: int = 0) -> list[int]:
    if kind == "uniform1024":
        return [1024] * max(1, total_tokens // 1024)
    if kind == "mix":
        lengths = lengths_lognormal(max(16, 4 * total_tokens // 600), seed)
        upto = int(np.searchsorted(np.cumsum(lengths), total_tokens)) + 1
        return lengths[:upto].tolist()
    raise ValueError(kind)


def write_dataset(path: Path, lengths: list[int], vocab: int, seed: int = 0) -> Path:
    """Pre-tokenised JSONL rows {"id", "input_ids", "loss_mask"}; ids below the tokenizer's vocabulary."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as fh:
        for i, n in enumerate(lengths):
            ids = rng.integers(0, vocab, n)
            mask = np.zeros(n, dtype=np.int64)
            mask[n // 3:] = 1
            fh.write(json.dumps({"id": f"s{i:07d}", "input_ids": ids.tolist(), "loss_mask": mask.tolist()}) + "\n")
    return path


def model_dir(path: Path, config) -> Path:
    """config.json of the benchmarked shape + the tiny tokenizer: all the producer reads of a model."""
    from hsx_tools.tinymodel import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    build_tokenizer(path)
    return path


# ---- services -----------------------------------------------------------
class Uploaders:
    """N ``hsx upload`` processes on this host's upload queue (not burst: they wait for work)."""

    def __init__(self, n: int, redis_url: str, spool_dir: Path, host: str, log_dir: Path,
                 memory_spool_dir: Path | None = None):
        env = {**os.environ, "HSX_REDIS_URL": redis_url, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.procs = []
        for i in range(n):
            log = open(log_dir / f"upload-{i}.log", "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "hsx_cli.main", "upload", "--spool-dir", str(spool_dir), "--host", host,
                 *(["--memory-spool-dir", str(memory_spool_dir)] if memory_spool_dir else []),
                 "--name", f"bench-upload-{i}-{os.getpid()}"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Monitor(threading.Thread):
    """Samples spool bytes, host RSS and NVML utilisation; deletes batch objects once in the store.

    The deletion stands in for S3: the bytes leave the machine. Uploaders still
    pay the whole copy + sha256 + fsync into the local-directory store.
    """

    def __init__(self, spool_dirs: list[Path], store_batches: Path, period: float = 0.1, gpu_index: int | None = None):
        super().__init__(daemon=True, name="bench-monitor")
        self.spool_dirs, self.store_batches, self.period = spool_dirs, store_batches, period
        self.stop_event = threading.Event()
        self.spool_peak = self.spool_files_peak = 0
        self.rss: list[tuple[float, int]] = []
        self.util: list[int] = []
        self._nvml = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu_index))
            except Exception:
                self._nvml = None

    def run(self) -> None:
        tick = 0
        while not self.stop_event.wait(self.period):
            usages = [spool.spool_usage(d) for d in self.spool_dirs]
            self.spool_peak = max(self.spool_peak, sum(u.bytes for u in usages))
            self.spool_files_peak = max(self.spool_files_peak, sum(u.files for u in usages))
            self.rss.append((time.perf_counter(), rss_bytes()))
            if self._nvml:
                nv, h = self._nvml
                self.util.append(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            tick += 1
            if tick % 5 == 0 and self.store_batches.exists():
                for path in self.store_batches.rglob("*.safetensors"):
                    if not path.name.startswith("."):
                        path.unlink(missing_ok=True)

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(timeout=5)
        rss = [b for _, b in self.rss]
        half = rss[len(rss) // 2:] or [0]
        return {"spool_peak_gib": self.spool_peak / GiB, "spool_files_peak": self.spool_files_peak,
                "rss_peak_gib": max(rss or [0]) / GiB, "rss_first_gib": (rss or [0])[0] / GiB,
                "rss_second_half_growth_gib": (half[-1] - half[0]) / GiB,
                "nvml_util_mean": (sum(self.util) / len(self.util)) if self.util else None}


def io_probe(directory: Path, gib: float = 2.0) -> dict:
    """Sequential write + fsync and sha256 speed on this host: what bounds the writer and the uploaders."""
    import hashlib

    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(64 * 2**20)
    n = max(1, int(gib * GiB // len(block)))
    path = directory / "io-probe.bin"
    t = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(n):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - t
    path.unlink()
    t = time.perf_counter()
    digest = hashlib.sha256()
    for _ in range(n):
        digest.update(block)
    sha_s = time.perf_counter() - t
    return {"write_fsync_gib_s": n * len(block) / GiB / write_s, "sha256_gib_s": n * len(block) / GiB / sha_s}


# ---- one pipeline run ---------------------------------------------------
@dataclasses.dataclass
class Services:
    work: Path
    redis_url: str
    r: object
    model_path: Path
    store_url: str
    spool_dir: Path
    host: str
    device: torch.device
    clock: Clock
    memory_spool_dir: Path | None = None   # the memory tier (tmpfs) when the benchmark uses one


def plan(svc: Services, run: str, dataset: Path, token_budget: int, dtype: str, layers: str = "dflash",
         store_dtype: str | None = None, codec: str = "none", compute_dtype: str = "bfloat16",
         fp8_accumulation: str = DEFAULT_FP8_ACCUMULATION):
    """Plan + enqueue a run through the real producer; return the batch specs in queue order."""
    from producer.produce import produce

    report = produce(make(
        ProduceConfig, run=run, dataset=dataset, model=str(svc.model_path), layers=layers,
        store=StoreSettings(url=svc.store_url), redis_url=svc.redis_url, token_budget=token_budget,
        max_length=4096, overlong="drop", max_batch_rows=512, pad_multiple=8, dtype=dtype,
        batches_per_shard=1000, tokenise_workers=1, enqueue=True, lease_seconds=600, store_dtype=store_dtype,
        codec=codec, compute_dtype=compute_dtype, fp8_accumulation=fp8_accumulation))
    specs = sorted(ledger.all_specs(svc.r, run).values(), key=lambda s: s.index)
    return report, specs


def run_pipeline(svc: Services, run: str, extractor: TimedExtractor, specs, warm: int,
                 spool_budget_bytes: int, timeout: float = 60, memory_budget_bytes: int = 0) -> dict:
    """Worker (rq, burst) in this thread + the uploaders already running; measured until the ledger is complete."""
    from gpu_worker.runtime import WorkerRuntime, measures_compute
    from gpu_worker.worker import run_worker
    from hsx.batch import codec

    manifest = ledger.get_manifest(svc.r, run)
    cfg = make(WorkerConfig, run=run, redis_url=svc.redis_url, device=str(svc.device), spool_dir=svc.spool_dir,
               spool_budget_bytes=spool_budget_bytes, host=svc.host, model_override=None, burst=True,
               worker_name=f"bench-gpu-{run}", heartbeat_seconds=5.0,
               grace_seconds=600.0,
               memory_spool_dir=svc.memory_spool_dir if memory_budget_bytes else None,
               memory_spool_budget_bytes=memory_budget_bytes)
    store = StoreSettings(url=svc.store_url).open()
    extractor.store_dtype = manifest.store_dtype
    rt = WorkerRuntime(cfg, svc.r, store, manifest, extractor, measure_compute=measures_compute(svc.r, run, manifest))
    monitor = Monitor([t.dir for t in cfg.tiers.tiers], Path(svc.store_url) / run / "batches",
                      gpu_index=svc.device.index if svc.clock.cuda else None)
    codec_before = (codec.STATS.seconds, codec.STATS.raw_bytes, codec.STATS.stored_bytes)
    cpu_before = time.process_time()
    extractor.marks, extractor.measured_extra = [], []
    if svc.clock.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    monitor.start()
    t0 = time.perf_counter()
    run_worker(cfg, rt)
    t_worker = time.perf_counter()
    total = len(specs)
    keys = RunKeys(run)
    last, last_change = -1, time.perf_counter()
    while (done := ledger.done_count(svc.r, run)) < total:
        if done != last:
            last, last_change = done, time.perf_counter()
        if time.perf_counter() - last_change > timeout or svc.r.hlen(keys.dead):
            monitor.stop()
            raise TimeoutError(f"run {run}: {done}/{total} batches done, failures "
                               f"{ledger.failures(svc.r, run) or ledger.dead_letters(svc.r, run)}")
        time.sleep(0.02)
    t_done = time.perf_counter()
    cpu_s = time.process_time() - cpu_before
    mon = monitor.stop()
    svc.clock.sync()
    out = summarise(extractor.marks, svc.clock, warm)
    tokens = sum(s.tokens for s in specs)
    out.update(mon)
    out.update({
        "all_batches": total, "all_tokens": tokens, "wall_worker_s": t_worker - t0, "wall_done_s": t_done - t0,
        "e2e_tok_s": tokens / (t_done - t0), "batches_run": rt.batches_run, "spooled": rt.writer.written,
        "peak_gib": torch.cuda.max_memory_allocated() / GiB if svc.clock.cuda else None,
        "pinned_gib": (rt.pinned.nbytes * rt.pinned.count / GiB) if rt.pinned else 0.0,
        "store_dtype": extractor.store_dtype, "codec": manifest.codec,
        "stored_bytes": rt.writer.stored_bytes, "raw_bytes": rt.writer.raw_bytes,
        "bytes_per_token": rt.writer.stored_bytes / max(tokens, 1),
        "codec_ratio": rt.writer.stored_bytes / max(rt.writer.raw_bytes, 1),
        "codec_wall_s_per_gb": (codec.STATS.seconds - codec_before[0]) / max((codec.STATS.raw_bytes - codec_before[1]) / 1e9, 1e-9),
        "process_cpu_s": cpu_s, "process_cpu_s_per_gb_raw": cpu_s / max(rt.writer.raw_bytes / 1e9, 1e-9),
        "tier_bytes": dict(rt.writer.rates.tier_bytes),
        "tier_write_gib_s": {t: rt.writer.rates.write_rate(t, len(rt.writer._threads)) / GiB
                             for t in rt.writer.rates.tier_bytes},
        "emit_gib_s": rt.writer.rates.emit_rate() / GiB,
        "tail_s": t_done - t_worker, "tail_share": (t_done - t_worker) / max(t_done - t0, 1e-9),
        "forward_s_all": sum(svc.clock.seconds(s, e) for s, e, *_ in extractor.marks),
        "compute_error_pass_s": sum(svc.clock.seconds(s, e) for passes in extractor.measured_extra
                                    for s, e, *_ in passes),
    })
    # Per-batch host cost beyond the forward (CPU mode: the forward is synchronous, so this is all orchestration).
    out["overhead_ms_per_batch"] = 1000 * (out["wall_worker_s"] - out["forward_s_all"]) / max(total, 1)
    return out


def start_services(work: Path, config, device: torch.device, n_uploaders: int, store_dir: str | None = None,
                   memory_spool_dir: str | None = None):
    from hsx.redisconn import LocalRedis, connect

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    redis_server = LocalRedis(work / "redis").start()
    r = connect(redis_server.url)
    host = f"bench{os.getpid()}"
    svc = Services(work=work, redis_url=redis_server.url, r=r, model_path=model_dir(work / "model", config),
                   store_url=store_dir or str(work / "store"), spool_dir=work / "spool", host=host, device=device,
                   clock=Clock(device), memory_spool_dir=Path(memory_spool_dir) if memory_spool_dir else None)
    (work / "logs").mkdir()
    uploaders = Uploaders(n_uploaders, redis_server.url, svc.spool_dir, host, work / "logs", svc.memory_spool_dir)
    return svc, redis_server, uploaders


def wait_uploaders(svc: Services, uploaders: Uploaders, timeout: float = 60) -> None:
    """Until every uploader is registered with rq (their start-up must not overlap a timed forward)."""
    from rq import Worker

    deadline = time.monotonic() + timeout
    while Worker.count(connection=svc.r) < len(uploaders.procs):
        if time.monotonic() > deadline or not uploaders.alive():
            raise RuntimeError(f"uploaders did not start; see {svc.work / 'logs'}")
        time.sleep(0.1)
