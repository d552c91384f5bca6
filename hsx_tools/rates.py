"""Extraction rates `hsx inspect` estimates: one GPU, and this machine's CPU.

A batch costs its compute plus a fixed cost: tokens_per_s = budget / (budget / compute_rate + BATCH_OVERHEAD_S).

- compute_rate on a GPU: one H200 at an effective 0.45 of its 989 TFLOP/s over the projection FLOPs of the
  decoder layers the forward runs (calibrated against the measured bare forwards in docs/benchmarks.md: 33.9k
  tokens/s for a Qwen3-8B shape with dflash layers, measured 31.7k; 7.4k for Qwen3-32B, measured 7.8-8.0k).
- BATCH_OVERHEAD_S: the pipeline's orchestration a batch (rq, Redis, spool file, upload, ledger), measured at
  13-21 ms in docs/benchmarks.md's CPU mode; a GPU does not make it smaller. It bounds a tiny model, whose
  FLOPs alone would claim a billion tokens/s, to budget / 15 ms (a 2,048-token budget: 137k tokens/s; the
  tiny model on the H200 measured 55k, start-up included). For an 8B shape at a 32k budget it costs 1.5 %.
- on a CPU, a range of computed (padded) tokens/s, this machine's cores over the same FLOPs, float32 (one
  figure, 45-53k, once stood where 10-25k was measured):
  - high: CPU_FLOPS_PER_CORE (8 GFLOP/s) a core and BATCH_OVERHEAD_S: a worker alone on its cores
    (docs/benchmarks.md's CPU mode: the tiny model, 36.5k tokens/s on 2 cores at a 4k budget);
  - low: CPU_FLOPS_PER_CORE_SHARED (3 GFLOP/s) a core and CPU_BATCH_OVERHEAD_S (90 ms: the spool write, Redis
    and rq of a batch on a loaded CPU): the cores shared with the producer, the uploaders or other users
    (measured 2026-12-05, `hsx worker --device cpu --burst`, tiny model, the shipped sample, 2 cores shared
    with six other users: 11.4k computed tokens/s at a 2,048 budget, 22.4k at 32,768; a two-point fit gives
    ~25k tokens/s of compute and ~90 ms a batch).
  Larger matrices run faster per FLOP on a CPU, so for a real model both ends lean slow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

H200_BF16_FLOPS = 989e12          # dense bf16 FLOP/s of one H200 (SXM)
DEFAULT_MFU = 0.45                # effective share of it, over projection FLOPs only (calibrated, see above)
BATCH_OVERHEAD_S = 0.015          # seconds of orchestration a batch (docs/benchmarks.md: 13-21 ms)
CPU_FLOPS_PER_CORE = 8e9          # effective float32 FLOP/s a core over projection FLOPs, cores of its own (see above)
CPU_FLOPS_PER_CORE_SHARED = 3e9   # the same, cores shared with the other roles and users (measured, see above)
CPU_BATCH_OVERHEAD_S = 0.09       # seconds a batch costs besides its FLOPs on a loaded CPU (measured, see above)


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    source: str


@dataclass(frozen=True)
class RateRange:
    """Computed (padded) tokens/s between two stated ends; ``source`` says what each end is based on."""
    low: float
    high: float
    source: str


def body_params(text_cfg, layers_run: int) -> int:
    """Parameters of the decoder layers a forward runs (attention + MLP projections; norms and embeddings left out)."""
    h = text_cfg.hidden_size
    heads = getattr(text_cfg, "num_attention_heads", None) or max(h // 128, 1)
    kv = getattr(text_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(text_cfg, "head_dim", None) or h // heads
    inter = getattr(text_cfg, "intermediate_size", None) or 4 * h
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * inter
    return per_layer * layers_run


def _bounded(compute_rate: float, token_budget: int) -> float:
    return token_budget / (token_budget / compute_rate + BATCH_OVERHEAD_S)


def gpu_rate(text_cfg, layers_run: int, token_budget: int) -> Rate:
    compute = DEFAULT_MFU * H200_BF16_FLOPS / (2 * body_params(text_cfg, layers_run))
    rate = _bounded(compute, token_budget)
    bound = " (bounded by the pipeline's ~15 ms a batch)" if rate < 0.9 * compute else ""
    return Rate(rate, f"default: one H200 at {DEFAULT_MFU} of peak over {layers_run} layers{bound}")


def cpu_rate(text_cfg, layers_run: int, token_budget: int, cores: int | None = None) -> RateRange:
    if not cores:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    flops_a_token = 2 * body_params(text_cfg, layers_run)
    low = token_budget / (token_budget * flops_a_token / (cores * CPU_FLOPS_PER_CORE_SHARED) + CPU_BATCH_OVERHEAD_S)
    high = _bounded(cores * CPU_FLOPS_PER_CORE / flops_a_token, token_budget)
    return RateRange(low, high, (
        f"computed tokens/s of `hsx worker --device cpu` on this machine's {cores} cores, float32: low with the cores "
        f"shared with the producer, uploaders or other users ({CPU_FLOPS_PER_CORE_SHARED / 1e9:g} GFLOP/s a core, "
        f"{CPU_BATCH_OVERHEAD_S * 1e3:.0f} ms a batch), high with them to itself ({CPU_FLOPS_PER_CORE / 1e9:g} "
        f"GFLOP/s, {BATCH_OVERHEAD_S * 1e3:.0f} ms); measured on the tiny model: 11-22k shared, 36.5k alone"))
