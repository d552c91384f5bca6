"""`hsx produce`: plan a run and enqueue its batches."""

from __future__ import annotations

from pathlib import Path

from hsx import defaults as D
from hsx.config import ProduceConfig
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, STORE_FLAGS, redis_url, store_settings
from hsx_cli.flags import Flag

MAX_TOKEN_BUDGET = 2**22  # tokens a batch; beyond this no GPU's memory holds one batch's hidden states

FLAGS = (
    Flag("--dataset", "JSONL, Parquet or a `datasets` folder", required=True),
    Flag("--model", "target model: local path or hub id", required=True),
    Flag("--layers", "dflash, dflash:N, eagle3 or a list like 1,9,17", default="dflash"),
    RUN,
    Flag("--store", "s3://bucket/prefix or a local directory", required=True),
    *STORE_FLAGS,
    REDIS_URL,
    Flag("--token-budget", "padded tokens a batch", type=int, default=D.DEFAULT_TOKEN_BUDGET, min=1,
         max=MAX_TOKEN_BUDGET),
    Flag("--max-length", "tokens a sample", type=int, default=D.DEFAULT_MAX_LENGTH, min=1),
    Flag("--overlong", "what to do with samples over --max-length (counted either way)", choices=("drop", "truncate"),
         default="drop"),
    Flag("--max-batch-rows", "samples a batch at most", type=int, default=D.DEFAULT_MAX_BATCH_ROWS, min=1),
    Flag("--pad-multiple", "round padded row length up to this", type=int, default=D.DEFAULT_PAD_MULTIPLE, min=1,
         max=4096),
    Flag("--dtype", "stored dtype", choices=("bfloat16", "float16", "float32"), default=D.DEFAULT_DTYPE),
    Flag("--batches-per-shard", "batches a store shard folder", type=int, default=D.DEFAULT_BATCHES_PER_SHARD, min=1,
         max=10**6),
    Flag("--tokenise-workers", "processes tokenising in parallel", type=int, default=1, min=1, max=256),
    Flag("--max-attempts", "run limit, kept in the manifest for every role: failures of a batch (extract error, "
         "worker lost, spool file lost) before it goes to dead letters", type=int, default=D.DEFAULT_MAX_ATTEMPTS,
         min=1, max=100),
    Flag("--lease-seconds", "run limit, kept in the manifest for every role: work of a process that stopped "
         "heartbeating is re-enqueued this long after its last beat", type=int, default=D.DEFAULT_LEASE_SECONDS,
         min=2, max=86400),
    Flag("--no-enqueue", "plan only; enqueue nothing", type=bool),
)


def config(v) -> ProduceConfig:
    return ProduceConfig(
        run=v["run"], dataset=Path(v["dataset"]), model=v["model"], layers=v["layers"], store=store_settings(v),
        redis_url=redis_url(v), token_budget=v["token_budget"], max_length=v["max_length"], overlong=v["overlong"],
        max_batch_rows=v["max_batch_rows"], pad_multiple=v["pad_multiple"], dtype=v["dtype"],
        batches_per_shard=v["batches_per_shard"], tokenise_workers=v["tokenise_workers"],
        enqueue=not v["no_enqueue"], max_attempts=v["max_attempts"], lease_seconds=v["lease_seconds"])


def run(cfg: ProduceConfig) -> int:
    from producer.produce import produce

    report = produce(cfg)
    print("\n".join(report.lines()))
    return 0


COMMAND = Command(
    "produce", "plan a run and enqueue its batches (safe to re-run)",
    "Tokenise the dataset with the model's chat template, cut length-bucketed batches under a token budget, "
    "record plan and manifest in Redis and the store, and enqueue every batch that is neither done nor pending.",
    FLAGS, config, run)
