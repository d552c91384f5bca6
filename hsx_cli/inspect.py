"""`hsx inspect`: what a dataset becomes for a model, and what the run will cost, before any GPU time."""

from __future__ import annotations

from hsx_cli.command import Command
from hsx_cli.flags import Flag
from hsx_cli.produce import (
    BATCH_FLAGS,
    DATASET,
    LAYERS,
    MIXTURE,
    MODEL,
    ROW_FLAGS,
    TOKEN_BUDGET,
    check_flags,
    columns,
    dataset_of,
    template_kwargs,
)

# The run's flags are produce's own declarations (hsx_cli/produce.py), so both refuse and default alike.
FLAGS = (
    DATASET, MIXTURE, MODEL, LAYERS,
    *ROW_FLAGS,
    TOKEN_BUDGET,
    *BATCH_FLAGS,
    Flag("--samples", "random samples printed with their loss mask", type=int, default=3, min=0),
    Flag("--seed", "seed of the sample draw", type=int, default=0),
    Flag("--sample-chars", "characters of a printed sample (plain output)", type=int, default=3000, min=1),
    Flag("--plain", "plain [[...]] markers even in a terminal", type=bool),
    Flag("--limit-rows", "read only about this many rows (whole windows); 0 = all", type=int, default=0, min=0),
    Flag("--gpu-tokens-per-s", "extraction rate of one GPU (default: one H200 at an effective 0.45 of its peak, for this model's size)",
         type=float, above=0),
    Flag("--gpu-usd-per-hour", "price of one GPU-hour, for a cost line", type=float, min=0),
    Flag("--storage-usd-per-tb-month", "storage price in USD per TB a month (default: S3 Standard's list price)",
         type=float, default=23.0, min=0),
)


def config(v):
    mix = check_flags(v)
    from hsx_tools.inspect import InspectConfig

    return InspectConfig(
        dataset=dataset_of(v, mix), mixture=mix, model=v["model"], layers=v["layers"], template_kwargs=template_kwargs(v),
        columns=columns(v), max_length=v["max_length"], overlong=v["overlong"], max_reject_share=v["max_reject_share"],
        tokenise_workers=v["tokenise_workers"], window_rows=v["window_rows"], token_budget=v["token_budget"],
        max_batch_rows=v["max_batch_rows"], pad_multiple=v["pad_multiple"], dtype=v["dtype"],
        store_dtype=v["store_dtype"], codec=v["codec"], compute_dtype=v["compute_dtype"],
        fp8_accumulation=v["fp8_accumulation"], per_turn=bool(v["per_turn"]), prefix_reuse=v["prefix_reuse"],
        prefix_min_tokens=v["prefix_min_tokens"], prefix_forward_tokens=v["prefix_forward_tokens"],
        prefix_stored_budgets=v["prefix_stored_budgets"], prefix_rows=v["prefix_rows"], samples=v["samples"],
        seed=v["seed"], sample_chars=v["sample_chars"], plain=v["plain"], limit_rows=v["limit_rows"],
        gpu_tokens_per_s=v["gpu_tokens_per_s"], gpu_usd_per_hour=v["gpu_usd_per_hour"],
        storage_usd_per_tb_month=v["storage_usd_per_tb_month"])


def run(cfg) -> int:
    from hsx_tools.inspect import run_inspect

    return run_inspect(cfg)


COMMAND = Command(
    "inspect", "what a dataset becomes for a model, and what the run costs, before any GPU time",
    "Tokenise the dataset as `hsx produce` would (no Redis, no store): rows per source format and per rejection "
    "reason, a token-length histogram, random samples with the loss-masked tokens highlighted ([[...]] when piped), "
    "and the plan's estimate: batches, padding, bytes to store, GPU-hours and storage cost a month.",
    FLAGS, config, run)
