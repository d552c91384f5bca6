"""`hsx worker`: run extract jobs on one GPU (or the CPU)."""

from __future__ import annotations

from pathlib import Path

from hsx import defaults as D
from hsx import runspec
from hsx.errors import ConfigError
from hsx.runspec import WorkerConfig
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, SPOOL_FLAGS, host, memory_spool_dir, redis_url, worker_name
from hsx_cli.flags import Flag


def gib_or_auto(text: str) -> float | str:
    """``auto`` or a number of GiB, at least 0."""
    if text.strip().lower() == "auto":
        return "auto"
    value = float(text)
    if not value >= 0:
        raise ValueError(f"expected auto or a number of GiB at least 0, not {text!r}")
    return value


gib_or_auto.__name__ = "GiB number or auto"

FLAGS = (
    RUN,
    Flag("--gpu", "GPU index (cuda:N); or --device", type=int, min=0, max=1023),
    Flag("--device", "torch device, e.g. cpu or cuda:1; or --gpu"),
    *SPOOL_FLAGS,
    Flag("--spool-budget-gb", "GiB the disk tier (--spool-dir) may hold", type=float,
         default=D.DEFAULT_SPOOL_BUDGET_BYTES / 2**30, above=0),
    Flag("--memory-spool-budget-gb", "GiB the memory tier (--memory-spool-dir) may hold; batch files go there first "
         "and to the disk tier only while it is full; auto: half of that tmpfs's free space at start, at most "
         f"{D.MEMORY_SPOOL_AUTO_CAP_BYTES // 2**30} GiB, off when it is not a tmpfs or has under "
         f"{D.MEMORY_SPOOL_AUTO_MIN_BYTES * 2 // 2**30} GiB free; 0: no memory tier", type=gib_or_auto, default="auto"),
    Flag("--model", "local path of the run's model if it differs from the manifest's", env="HSX_WORKER_MODEL"),
    Flag("--wait-for-plan", "if the run is not planned yet, wait for `hsx produce` instead of exiting", type=bool),
    Flag("--exit-when-complete", "exit 0 once every batch of the run is done (checked at start, before the model "
         "loads, and at every heartbeat) instead of waiting for more jobs: for batch schedulers (SLURM array tasks)",
         type=bool),
    Flag("--kernels", "the forward's kernels: auto = fused (flash-linear-attention's RMSNorm, SwiGLU, Gated DeltaNet "
         "conv and gating) where installed on a CUDA device, and a plain batch's samples packed into one row (varlen "
         "attention and GDN: no padding computed) where exact, else transformers' forward; padded = the same fused "
         "kernels on right-padded rows; eager = transformers' forward always", choices=D.KERNEL_MODES,
         default=D.DEFAULT_KERNELS, env="HSX_KERNELS"),
    Flag("--prefix-forward-tokens", "where this worker runs batches of shared-prefix trees group by group (no packed "
         "rows: no fla, or a CPU), the price of one of its forwards in tokens: such a batch runs its samples alone "
         "where that costs less than its trees at this price (measured on the 27B: docs/data.md); 0: every tree as "
         "planned. A worker that packs runs trees in waves and ignores it", type=int,
         default=D.GROUPWISE_PREFIX_FORWARD_TOKENS, min=0, env="HSX_WORKER_PREFIX_FORWARD_TOKENS"),
    Flag("--grace-seconds", "on SIGTERM, seconds to finish writing computed batches before handing the rest back",
         type=float, default=D.DEFAULT_GRACE_SECONDS, min=0),
    REDIS_URL,
)


def config(v) -> WorkerConfig:
    if v["gpu"] is not None and v["device"] is not None:
        raise ConfigError(f"--gpu {v['gpu']} and --device {v['device']}: give one (or one of HSX_GPU / HSX_DEVICE)")
    device = v["device"] or (f"cuda:{v['gpu']}" if v["gpu"] is not None else None)
    if device is None:
        raise ConfigError("say which device: --gpu N or --device cpu (or HSX_GPU / HSX_DEVICE)")
    memory_dir = memory_spool_dir(v)
    if v["memory_spool_budget_gb"] == "auto":
        memory_budget, why = runspec.auto_memory_budget(memory_dir)
    else:
        memory_budget = int(v["memory_spool_budget_gb"] * 2**30)
        why = "--memory-spool-budget-gb" + ("" if memory_budget else ": memory tier off")
    return WorkerConfig(
        run=v["run"], redis_url=redis_url(v), device=device, spool_dir=Path(v["spool_dir"]),
        spool_budget_bytes=int(v["spool_budget_gb"] * 2**30), host=host(v), model_override=v["model"],
        burst=v["burst"], worker_name=v["name"] or worker_name("gpu", host(v), device.replace(":", "")),
        heartbeat_seconds=v["heartbeat_seconds"], grace_seconds=v["grace_seconds"],
        wait_for_plan=v["wait_for_plan"],
        exit_when_complete=v["exit_when_complete"],
        log_every_seconds=v["log_every_seconds"], memory_spool_dir=memory_dir,
        memory_spool_budget_bytes=memory_budget, memory_spool_why=why, kernels=v["kernels"],
        prefix_forward_tokens=v["prefix_forward_tokens"])


def run(cfg: WorkerConfig) -> int:
    from gpu_worker.worker import run_worker

    rt = run_worker(cfg)
    if rt is None:
        print(f"worker {cfg.worker_name}: run {cfg.run} is complete, nothing to do (--exit-when-complete)")
        return 0
    print(f"worker {cfg.worker_name}: {rt.batches_run} batches, {rt.tokens_run} tokens, {rt.writer.written} spooled")
    return 0


COMMAND = Command(
    "worker", "run extract jobs on one GPU (or the CPU), model loaded once",
    "An rq worker on the run's extract queue. Loads the model once, runs each batch, writes one packed "
    "safetensors file per batch into the local spool and enqueues its upload on this host's upload queue. "
    "Stops taking jobs while the spool is over budget. Attempts and lease length are the run's (hsx produce).",
    FLAGS, config, run)
