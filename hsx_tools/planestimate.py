"""`hsx inspect`'s plan estimate and the lines it prints beside it: batches, padding, bytes stored, GPU-hours and
storage cost of a dataset's lengths (hsx_tools/inspect.py's text says how each is estimated), the token-length
histogram, and what FP8 storage and compute cost in fidelity."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hsx.prep import cut_batches, padding_fraction
from hsx_tools.rates import RateRange, cpu_rate, gpu_rate

HISTOGRAM_EDGES = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class Estimate:
    batches: int
    padding: float
    tokens: int
    padded_tokens: int
    bytes_per_token: int
    stored_bytes: int
    tokens_per_s: float
    rate_source: str
    gpu_hours: float
    storage_usd_month: float
    cpu: RateRange            # the same plan on this machine's CPU


def estimate(lengths: np.ndarray, text_cfg, layer_ids: list[int], store_final: bool, dtype: str, token_budget: int,
             max_rows: int, pad_multiple: int, window_rows: int, tokens_per_s: float | None,
             storage_usd_per_tb_month: float, codec: str = "none") -> Estimate:
    """``dtype``: what batch files hold (the run's store dtype)."""
    batches = []
    for start in range(0, len(lengths), window_rows):
        batches += cut_batches(lengths[start:start + window_rows], token_budget, max_rows, pad_multiple)
    tokens = int(lengths.sum())
    padded = sum(b.padded for b in batches)
    from hsx.batch import stored_bytes_per_token

    per_token = stored_bytes_per_token(text_cfg.hidden_size, len(layer_ids) + int(store_final), dtype, codec)
    layers_run = text_cfg.num_hidden_layers if store_final else max(layer_ids) + 1
    if tokens_per_s:
        source = "given"
    else:
        rate = gpu_rate(text_cfg, layers_run, token_budget)
        tokens_per_s, source = rate.tokens_per_s, rate.source
    stored = tokens * per_token
    return Estimate(len(batches), padding_fraction(batches), tokens, padded, per_token, stored, tokens_per_s,
                    source, padded / tokens_per_s / 3600, stored / 1e12 * storage_usd_per_tb_month,
                    cpu_rate(text_cfg, layers_run, token_budget))


def histogram_lines(lengths: np.ndarray, width: int = 40) -> list[str]:
    if not len(lengths):
        return ["  (no samples)"]
    edges = [e for e in HISTOGRAM_EDGES if e < lengths.max()] + [int(lengths.max()) + 1]
    counts, _ = np.histogram(lengths, bins=edges)
    top = max(counts.max(), 1)
    lines = [f"  mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, "
             f"max {lengths.max()} tokens"]
    for lo, hi, n in zip(edges[:-1], edges[1:], counts, strict=False):
        lines.append(f"  {lo:>6}-{hi - 1:<6} {n:>9}  {'#' * int(round(width * n / top))}")
    return lines


# rel L2 a stored layer of FP8 compute against bf16 compute, by accumulation (docs/benchmarks.md, bench/fp8_fidelity.py)
COMPUTE_ERROR = {"fp32": "~1.1 %", "fast": "~1.5 %"}


def precision_lines(store_dtype: str, compute_dtype: str, accumulation: str = "fp32") -> list[str]:
    """What FP8 storage and FP8 compute cost in fidelity, before the run: the figures of docs/benchmarks.md
    (bench/fp8_fidelity.py, a small Qwen3 trained on the GPU) and where the run's own measurement appears."""
    lines = []
    if compute_dtype == "float8":
        lines.append(f"  precision: FP8 compute {COMPUTE_ERROR[accumulation]} rel L2 a stored layer against bf16 compute "
                     f"({accumulation} accumulation, cosine 0.9999); the run measures its own on its first batch: "
                     "hsx status, the dashboard, <run>/compute_error.json")
    if store_dtype == "float8_e4m3":
        lines.append("  precision: FP8 storage ~2.6 % rel L2 a stored layer against the bf16 values (cosine 0.9997); "
                     "the run measures its own on every 16th batch: hsx status, the dashboard, <run>/store_error.json")
    if lines:
        lines.append("    (figures of a small Qwen3 trained on the GPU, docs/benchmarks.md: real checkpoints' outlier "
                     "channels may cost more; the run's own figures are the ones to trust)")
    return lines
