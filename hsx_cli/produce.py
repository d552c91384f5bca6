"""`hsx produce`: plan a run and enqueue its batches."""

from __future__ import annotations

from pathlib import Path

from hsx import defaults as D
from hsx.errors import ConfigError
from hsx.printable import printable
from hsx.runspec import ProduceConfig
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, STORE_FLAGS, redis_url, store_settings
from hsx_cli.flags import Flag

MAX_TOKEN_BUDGET = D.MAX_TOKEN_BUDGET

# How rows become samples, and how many may be rejected: shared with `hsx inspect`.
ROW_FLAGS = (
    Flag("--template-kwargs", "chat-template arguments: a JSON object or key=value,... (e.g. enable_thinking=true); "
         "recorded in the manifest, another value is another run"),
    Flag("--columns", "instruction columns -> turns, e.g. 'user=instruction+input,assistant=output', or a JSON file "
         "(docs/data.md)"),
    Flag("--max-length", "tokens a sample", type=int, default=D.DEFAULT_MAX_LENGTH, min=1),
    Flag("--overlong", "what to do with samples over --max-length (counted either way)", choices=("drop", "truncate"),
         default="drop"),
    Flag("--max-reject-share", "fail (exit 2, nothing left on the queue) when more than this share of the rows is "
         "rejected", type=float, default=D.DEFAULT_MAX_REJECT_SHARE, min=0, max=1),
    Flag("--tokenise-workers", "processes tokenising in parallel; 0 = every core (one per 2 MB of a small dataset)",
         type=int, default=0, min=0, max=1024),
    Flag("--per-turn", "one sample per assistant turn, each the conversation up to that turn as the template renders "
         "it, its mask on that turn: every turn's reasoning trained where the template drops it from history "
         "(docs/data.md); sample ids <row id>#t<j>; recorded in the manifest", type=bool),
    Flag("--window-rows", "dataset rows sorted and cut into batches together; each window is enqueued as soon as it "
         "is planned, while the next is tokenised", type=int, default=D.DEFAULT_WINDOW_ROWS, min=1),
)


def template_kwargs(v) -> dict:
    from hsx.prep import parse_template_kwargs

    try:
        return parse_template_kwargs(v["template_kwargs"])
    except ValueError as exc:
        raise ConfigError(f"--template-kwargs: {exc}") from None


def columns(v):
    from hsx.prep import ColumnMapping, ColumnMappingError

    if not v["columns"]:
        return None
    try:
        return ColumnMapping.parse(v["columns"])
    except ColumnMappingError as exc:
        raise ConfigError(f"--columns: {exc}") from None


# What a run is planned from: declared once, shared with `hsx inspect` (same limits, same help).
DATASET = Flag("--dataset", "JSONL, Parquet or a `datasets` folder; given several times, a mixture: one source each, "
               "named by its file, sample ids as NAME/ID (docs/data.md); the variable takes a comma-separated list",
               repeat=True)
MIXTURE = Flag("--mixture", "a mixture file (JSON, or YAML for .yaml/.yml; instead of --dataset): its sources, each with its own columns, "
               "template arguments, a cap or share of rows and a seed (docs/data.md, \"A mixture\")")
MODEL = Flag("--model", "target model: local path or hub id", required=True)
LAYERS = Flag("--layers", "dflash, dflash:N, eagle3 or a list like 1,9,17; +final also stores the final state",
              default="dflash")
TOKEN_BUDGET = Flag("--token-budget", "padded tokens a batch", type=int, default=D.DEFAULT_TOKEN_BUDGET, min=1,
                    max=MAX_TOKEN_BUDGET)
BATCH_FLAGS = (
    Flag("--max-batch-rows", "samples a batch at most", type=int, default=D.DEFAULT_MAX_BATCH_ROWS, min=1),
    Flag("--pad-multiple", "round padded row length up to this", type=int, default=D.DEFAULT_PAD_MULTIPLE, min=1,
         max=4096),
    Flag("--dtype", "dtype of the hidden states readers get", choices=("bfloat16", "float16", "float32"),
         default=D.DEFAULT_DTYPE),
    Flag("--store-dtype", "what batch files hold: the --dtype (default) or float8_e4m3 (one float32 scale a token a "
         "layer, quantised on the GPU; about half the bytes of bfloat16; error measured into <run>/store_error.json)",
         choices=D.STORE_DTYPES),
    Flag("--codec", "lossless compression of the hidden states on the workers' writer threads: none or zstd "
         "(byte planes, the exponent plane compressed)", choices=D.CODECS, default="none"),
    Flag("--compute-dtype", "the target's linear layers: bfloat16, or float8 (e4m3 weights and per-token activations, "
         "rowwise-scaled GEMMs, ~1.3x faster on H100/H200; workers on GPUs without FP8 tensor cores refuse; "
         "attention and recurrent kernels stay bf16; fidelity in docs/benchmarks.md; `hsx inspect` prints what FP8 "
         "storage and compute each cost against bf16)", choices=D.COMPUTE_DTYPES, default="bfloat16"),
    Flag("--fp8-accumulation", "how --compute-dtype float8's GEMMs accumulate: fp32 (partial sums promoted to fp32, "
         "the default) or fast (the tensor cores' own accumulator: ~3 % faster on an H200, ~35 % more error on "
         "trained weights; docs/benchmarks.md)", choices=D.FP8_ACCUMULATIONS, default=D.DEFAULT_FP8_ACCUMULATION),
    Flag("--prefix-reuse", "auto: rows sharing a prefix of at least --prefix-min-tokens tokens compute it once, every "
         "sample still stored whole (on for the model types shown exact: docs/data.md); off: each sample computed "
         "alone. Recorded in the manifest", choices=D.PREFIX_REUSE, default="auto"),
    Flag("--prefix-min-tokens", "tokens rows must share for --prefix-reuse to compute them once", type=int,
         default=D.DEFAULT_PREFIX_MIN_TOKENS, min=1),
    Flag("--prefix-forward-tokens", "the price of one more forward, in tokens, against what a tree of shared "
         "prefixes saves: a tree is planned only where it saves more (the default is priced for GPU workers that pack "
         "rows, as the gpu image's do; 2560 where the workers cannot: docs/data.md). Recorded in the manifest", type=int,
         default=D.DEFAULT_PREFIX_FORWARD_TOKENS, min=1),
    Flag("--prefix-rows", "how the workers run a batch of shared-prefix trees, planned for: packed (one packed row a "
         "forward, as GPU workers with fla's kernels do: a tree's rows are not padded, and rows sharing nothing ride "
         "in its forwards) or padded (workers that cannot pack: a group's rows padded to its longest; plan those "
         f"with --prefix-forward-tokens {D.GROUPWISE_PREFIX_FORWARD_TOKENS}). Recorded in the manifest",
         choices=D.PREFIX_ROWS, default=D.PREFIX_ROWS[0]),
    Flag("--prefix-stored-budgets", "token budgets a batch of shared-prefix trees may store, its forwards each "
         "still within one budget: more fills a tree batch's forwards (its computed tokens are a fraction of its "
         "stored ones) at the price of larger batch files and host buffers (docs/data.md). 0 (the default): "
         f"{D.DEFAULT_PREFIX_STORED_BUDGETS}, or as many as the pinned host buffers' bound allows. Recorded in the "
         "manifest", type=int, default=D.AUTO_PREFIX_STORED_BUDGETS, min=0, max=D.MAX_PREFIX_STORED_BUDGETS),
)

FLAGS = (
    DATASET, MIXTURE, MODEL, LAYERS,
    RUN,
    Flag("--store", "s3://bucket/prefix or a local directory", required=True),
    *STORE_FLAGS,
    REDIS_URL,
    TOKEN_BUDGET,
    *ROW_FLAGS,
    *BATCH_FLAGS,
    Flag("--batches-per-shard", "batches a store shard folder", type=int, default=D.DEFAULT_BATCHES_PER_SHARD, min=1,
         max=10**6),
    Flag("--lock-wait", "seconds to wait while another producer works on this run, then refuse (two at once would "
         "enqueue every batch twice); 0 refuses at once", type=float, default=D.DEFAULT_PRODUCER_LOCK_WAIT, min=0),
    Flag("--max-attempts", "run limit, kept in the manifest for every role: failures of a batch (extract error, "
         "worker lost, spool file lost) before it goes to dead letters", type=int, default=D.DEFAULT_MAX_ATTEMPTS,
         min=1, max=100),
    Flag("--lease-seconds", "run limit, kept in the manifest for every role: work of a process that stopped "
         "heartbeating is re-enqueued this long after its last beat", type=int, default=D.DEFAULT_LEASE_SECONDS,
         min=2, max=86400),
    Flag("--no-enqueue", "plan only: a new run stays off every queue (no reconciler enqueues it) until this command "
         "runs without the flag", type=bool),
)


def mixture(v):
    """The run's mixture (hsx.prep.Mixture, paths resolved): --mixture, or --dataset given several times; None for
    one --dataset (ids and manifest as before mixtures)."""
    from hsx.prep import load_mixture, mixture_of_datasets

    datasets = v["dataset"]
    if v["mixture"] and datasets:
        raise ConfigError("give --dataset (once or several times) or --mixture FILE, not both")
    if not v["mixture"] and not datasets:
        raise ConfigError("--dataset is required (or set HSX_DATASET), or --mixture FILE")
    if v["mixture"]:
        return load_mixture(v["mixture"]).resolved()
    return mixture_of_datasets(datasets).resolved() if len(datasets) > 1 else None


def dataset_of(v, mix) -> Path:
    """The run's ``dataset`` (the manifest's): the one --dataset, the mixture file, or the first source."""
    from hsx.prep import resolve_dataset

    return mix.dataset if mix is not None else resolve_dataset(v["dataset"][0])


def check_flags(v):
    """The checks `hsx produce` and `hsx inspect` share, made before any heavy import (seconds, not tens).
    Returns the mixture (None for one --dataset)."""
    from hsx.prep import check_budget, check_row_settings

    check_row_settings(v["overlong"], v["max_reject_share"])
    check_budget(v["max_length"], v["token_budget"], v["pad_multiple"])
    mix = mixture(v)
    dataset_of(v, mix)
    return mix


def config(v) -> ProduceConfig:
    mix = check_flags(v)
    return ProduceConfig(
        run=v["run"], dataset=dataset_of(v, mix), mixture=mix, model=v["model"], layers=v["layers"], store=store_settings(v),
        redis_url=redis_url(v), token_budget=v["token_budget"], max_length=v["max_length"], overlong=v["overlong"],
        max_batch_rows=v["max_batch_rows"], pad_multiple=v["pad_multiple"], dtype=v["dtype"],
        batches_per_shard=v["batches_per_shard"], tokenise_workers=v["tokenise_workers"],
        enqueue=not v["no_enqueue"], max_attempts=v["max_attempts"], lease_seconds=v["lease_seconds"],
        template_kwargs=template_kwargs(v), columns=columns(v), window_rows=v["window_rows"],
        max_reject_share=v["max_reject_share"], lock_wait_seconds=v["lock_wait"],
        store_dtype=v["store_dtype"], codec=v["codec"], compute_dtype=v["compute_dtype"],
        fp8_accumulation=v["fp8_accumulation"], per_turn=bool(v["per_turn"]), prefix_reuse=v["prefix_reuse"],
        prefix_min_tokens=v["prefix_min_tokens"], prefix_forward_tokens=v["prefix_forward_tokens"],
        prefix_stored_budgets=v["prefix_stored_budgets"], prefix_rows=v["prefix_rows"])


def run(cfg: ProduceConfig) -> int:
    from producer.produce import produce

    report = produce(cfg)
    print("\n".join(printable(line) for line in report.lines()))   # rows' ids and messages: shown, not obeyed
    return 0


COMMAND = Command(
    "produce", "plan a run and enqueue its batches (safe to re-run)",
    "Tokenise the dataset with the model's chat template on every core, window by window: cut each window's samples "
    "into length-bucketed batches under a token budget, record plan and manifest in Redis and the store, and enqueue "
    "every batch that is neither done nor pending, while the next window is tokenised. Fails, with nothing left on the "
    "queue, when more than --max-reject-share of the rows is rejected. A killed producer resumes at its first "
    "unfinished window; a second producer of the same run refuses (or waits, --lock-wait).",
    FLAGS, config, run)
