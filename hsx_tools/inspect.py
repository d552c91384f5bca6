"""`hsx inspect`: what a dataset becomes for a model, before any GPU time.

Tokenises the dataset exactly as `hsx produce` would (same row formats,
template arguments, column mapping, max length, windows), touching neither
Redis nor the store, and prints: rows per source format and per rejection
reason; a token-length histogram; N random samples with the loss-masked
tokens highlighted (colour in a terminal, ``[[...]]`` when piped); how the chat template's assistant
turns are located (a row that cannot be located is quoted with the text around the place); and the
plan's estimate: batches, padding, bytes to store, GPU-hours and storage cost.

Estimates (units in the names):
- bytes stored = tokens x (stored layers x hidden) x bytes of the run's store
  dtype (FP8: 1, plus a float32 scale a token a layer), x the zstd ratio measured
  in docs/benchmarks.md when --codec zstd, plus 5 bytes a token of input ids +
  mask (the batch file's payload; headers are small): hsx.batch.batchfile.
  stored_bytes_per_token, as a run's Manifest.bytes_per_token.
- GPU-hours = computed (padded) tokens / tokens_per_s / 3600, at --gpu-tokens-per-s or the default rate of
  hsx_tools/rates.py: one H200's FLOPs over the decoder layers the forward runs (up to the last stored one),
  bounded by the pipeline's measured cost a batch (no tiny model reads a billion tokens/s); a CPU run's hours
  at this machine's cores beside it.
- instruction rows: which --columns mapping or built-in preset reads them, and the non-empty columns left
  out (hsx_tools/columnuse.py).
- shared-prefix share: the tokens lying in a prefix another row shares (hsx_tools/prefixshare.py); with
  --per-turn, of the expanded samples, beside rows in and out and the tokens the whole rows would store (the
  dataset tokenised a second time without the expansion).
- storage cost / month = stored bytes (decimal TB) x --storage-usd-per-tb-month
  (default 23: S3 Standard's list price; set your own).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx.layers import TARGETS, feeds
from hsx.monitor import fmt_bytes
from hsx.prep import (
    SettingsError,
    TokeniseReport,
    TokeniseSettings,
    WindowTokeniser,
    check_budget,
    check_row_settings,
    default_workers,
    resolve_dataset,
    resolve_model,
)
from hsx.printable import printable
from hsx_tools.columnuse import column_lines, column_use
from hsx_tools.planestimate import estimate, histogram_lines, precision_lines
from hsx_tools.prefixshare import PrefixPrediction, prefix_share
from hsx_tools.samplerender import render_sample, sample_segments
from hsx_tools.sourcereport import source_lines, tally

DEFAULT_STORAGE_USD_PER_TB_MONTH = 23.0
PREFIX_SHARE_TOKENS = 20_000_000  # tokens of rows kept for the shared-prefix share (~160 MB with the sort's copy)
TEMPLATE_ROWS = 200   # rows whose assistant turns are located again to say how (the report counts every row)


@dataclass(frozen=True)
class InspectConfig:
    dataset: Path
    model: str
    layers: str
    template_kwargs: dict
    columns: object                 # hsx.prep.columns.ColumnMapping or None
    max_length: int
    overlong: str                   # drop | truncate
    max_reject_share: float         # shown beside the rejected share: where produce would fail
    tokenise_workers: int           # 0 = every core
    window_rows: int
    token_budget: int
    max_batch_rows: int
    pad_multiple: int
    dtype: str
    store_dtype: str | None         # what batch files hold (None: dtype), e.g. float8_e4m3
    codec: str                      # none | zstd
    compute_dtype: str              # bfloat16 | float8: the target's linear layers
    fp8_accumulation: str           # fp32 | fast: how float8 GEMMs accumulate
    per_turn: bool                  # one sample a turn of each row (hsx/prep/perturn.py)
    prefix_reuse: str               # auto | off: shared prefixes computed once (hsx/prep/prefixplan.py)
    prefix_min_tokens: int
    prefix_forward_tokens: int      # a forward's price in tokens (the plan's --prefix-forward-tokens)
    samples: int                    # random samples printed with their loss mask
    seed: int
    sample_chars: int               # characters of a printed sample (plain output)
    plain: bool                     # [[...]] markers even on a terminal
    limit_rows: int                 # 0 = every row
    gpu_tokens_per_s: float | None  # None: the default rate for the model's size
    gpu_usd_per_hour: float | None
    storage_usd_per_tb_month: float
    mixture: object = None          # hsx.prep.Mixture (dataset: its file or first source), or None: one dataset
    prefix_stored_budgets: int = 0  # token budgets a batch of trees stores (the plan's --prefix-stored-budgets; 0: auto)
    prefix_rows: str = "packed"     # packed | padded: how the workers run a tree batch's rows (--prefix-rows)


def whole_rows(cfg: InspectConfig, settings: TokeniseSettings) -> tuple[int, int]:
    """(samples, tokens) of the same rows without --per-turn: what the expansion is measured against."""
    from dataclasses import replace

    samples = tokens = rows = 0
    dataset = cfg.mixture if cfg.mixture is not None else cfg.dataset   # every source of a mixture
    with WindowTokeniser(dataset, replace(settings, per_turn=False),
                         cfg.tokenise_workers or default_workers(dataset), cfg.window_rows) as windows:
        for window in windows:
            rows += window.report.rows
            samples += len(window.samples)
            tokens += sum(len(s.input_ids) for s in window.samples)
            if cfg.limit_rows and rows >= cfg.limit_rows:
                break
    return samples, tokens


def per_turn_lines(report: TokeniseReport, tokens: int, whole: tuple[int, int]) -> list[str]:
    """--per-turn: rows in and out, the tokens stored against the whole rows', and whether it adds anything."""
    whole_samples, whole_tokens = whole
    lines = [f"per-turn: {report.turn_rows} rows -> {report.kept} samples (one a turn, as the template renders "
             f"history; {report.kept / max(report.turn_rows, 1):.2f} a row), {tokens:,} tokens stored against "
             f"{whole_tokens:,} for the {whole_samples} whole rows (x{tokens / max(whole_tokens, 1):.2f}, "
             f"{tokens - whole_tokens:+,})"]
    if report.kept == report.turn_rows:
        lines.append("  every row is one turn here: the template renders each earlier turn as when the conversation ends "
                     "with it (no reasoning dropped), so the whole rows already train every turn as generated; "
                     "--per-turn adds nothing but the ids' #t0 (and cuts messages after the last assistant turn)")
    return lines


def first_rows(cfg: InspectConfig) -> Path:
    """The rows the template and column lines read: the dataset, or a mixture's first source."""
    return cfg.mixture.sources[0].path if cfg.mixture else cfg.dataset


def template_lines(tokenizer, cfg: InspectConfig) -> list[str]:
    """How the chat template's assistant turns are located (and tool-call arguments passed), and how the
    turns of the dataset's first TEMPLATE_ROWS rows were located."""
    from hsx.errors import HsxError
    from hsx.prep import ChatTokeniser, RowError, iter_rows

    if not getattr(tokenizer, "chat_template", None):
        return ["template: none (only pre-tokenised rows can be used)"]
    try:
        chat = ChatTokeniser(tokenizer, template_kwargs=cfg.template_kwargs, columns=cfg.columns)
    except HsxError as exc:
        return [f"template: {exc}"]
    rows = 0
    for row in iter_rows(first_rows(cfg)):
        if rows == TEMPLATE_ROWS:
            break
        rows += 1
        if not isinstance(row, RowError):
            try:
                (chat.encode_turns if cfg.per_turn else chat.encode_row)(row.data, row.index)
            except Exception:   # counted and quoted by the tokenising report below
                pass
    lines = [f"template: {chat.locating}"]
    if chat.located:
        lines.append(f"  assistant turns of the first {rows} rows located by {chat.located_counts()}")
    return lines


@dataclass
class Seen:
    """What tokenising the rows gave: the report, each kept sample's length, the samples printed, the ids the
    shared-prefix share is measured over, the tally by source and the prefix-reuse prediction."""
    report: TokeniseReport
    lengths: np.ndarray
    picked: list
    every_ids: list
    by_source: dict
    reuse: PrefixPrediction


def read_rows(cfg: InspectConfig, settings: TokeniseSettings, reuse: PrefixPrediction) -> Seen:
    """Tokenise the rows as `hsx produce` would, window by window (up to --limit-rows)."""
    rng = random.Random(cfg.seed)
    report, lengths, picked, kept_seen, every_ids, kept_tokens = TokeniseReport(), [], [], 0, [], 0
    dataset, by_source = cfg.mixture or cfg.dataset, {}
    with WindowTokeniser(dataset, settings, cfg.tokenise_workers or default_workers(dataset), cfg.window_rows) as windows:
        for window in windows:
            report.merge(window.report)
            tally(by_source, window)
            reuse.add(window.samples)
            for sample in window.samples:          # reservoir: N samples uniformly over the kept rows
                lengths.append(len(sample.input_ids))
                if kept_tokens < PREFIX_SHARE_TOKENS:   # the shared-prefix share is measured over these rows
                    every_ids.append(sample.input_ids)
                    kept_tokens += len(sample.input_ids)
                kept_seen += 1
                if len(picked) < cfg.samples:
                    picked.append(sample)
                elif (j := rng.randrange(kept_seen)) < cfg.samples:
                    picked[j] = sample
            if cfg.limit_rows and report.rows >= cfg.limit_rows:
                break
    return Seen(report, np.asarray(lengths, dtype=np.int64), picked, every_ids, by_source, reuse)


def run_inspect(cfg: InspectConfig) -> int:
    """Print the report; the checks `hsx produce` makes fail the same way (HsxError: one line, exit 2): its
    settings' checks, then the same identify step (hsx.runspec.identify: layers, store dtype)."""
    from dataclasses import replace

    from hsx.runspec import identify

    check_row_settings(cfg.overlong, cfg.max_reject_share)
    check_budget(cfg.max_length, cfg.token_budget, cfg.pad_multiple)
    cfg = replace(cfg, dataset=cfg.mixture.dataset if cfg.mixture else resolve_dataset(cfg.dataset),
                  model=resolve_model(cfg.model))
    target = identify(cfg)
    settings = TokeniseSettings.of(cfg.model, cfg.max_length, cfg.overlong, cfg.template_kwargs, cfg.columns,
                                   cfg.mixture, cfg.per_turn)
    seen = read_rows(cfg, settings, PrefixPrediction.of(cfg, target.text_cfg.model_type, target.stored_budgets))
    print_rows(cfg, target.tokenizer, settings, seen)
    if not len(seen.lengths):
        print("plan: nothing to plan (no usable rows)")
        raise SettingsError(f"{cfg.dataset}: no usable rows out of {seen.report.rows}; nothing to plan (hsx produce "
                            "would fail the same way)")
    print_plan(cfg, target, seen)
    return 0


def print_rows(cfg: InspectConfig, tokenizer, settings: TokeniseSettings, seen: Seen) -> None:
    """The rows: template, formats, rejections, sources, lengths, shared prefixes, per-turn, the samples."""
    report, lengths = seen.report, seen.lengths
    tty = sys.stdout.isatty() and not cfg.plain
    named = (f"mixture of {', '.join(src.name for src in cfg.mixture.sources)}" if cfg.mixture is not None
             else f"dataset {cfg.dataset}")
    print(f"{named} for {cfg.model}"
          + (f", template arguments {cfg.template_kwargs}" if cfg.template_kwargs else ""))
    print("\n".join(template_lines(tokenizer, cfg)))
    print(f"rows: {report.rows} read, {report.kept} kept, {report.truncated} truncated, "
          f"{report.dropped_overlong} over {cfg.max_length} tokens dropped, {report.rejected_rows} rejected "
          f"({report.reject_share():.2%}; produce fails above {cfg.max_reject_share:.2%})")
    print("  by format: " + ", ".join(f"{k} {v}" for k, v in sorted(report.formats.items())))
    for line in column_lines(*column_use(first_rows(cfg), cfg.columns)):
        print(printable(line))      # column names are the dataset's
    for code, n in report.rejected.most_common():
        print(f"  rejected {n} x {code}")
    for example in report.examples[:10]:
        print(f"    {printable(example)}")
    for line in source_lines(cfg.mixture, seen.by_source) if cfg.mixture else []:
        print(line)
    print("token lengths (kept samples):")
    print("\n".join(histogram_lines(lengths)))
    if seen.every_ids:
        over = f", first {len(seen.every_ids):,} kept rows" if len(seen.every_ids) < len(lengths) else ""
        named = f"{len(cfg.mixture.sources)} sources" if cfg.mixture is not None else cfg.dataset.name
        print(prefix_share(seen.every_ids).line(f"shared prefixes ({named}{over}"
                                                + (", one sample a turn" if cfg.per_turn else "") + ", ids after the template)"))
    if cfg.per_turn:
        print("\n".join(per_turn_lines(report, int(lengths.sum()), whole_rows(cfg, settings))))
    console = None
    if tty:
        from rich.console import Console

        console = Console(highlight=False)
    marker = "in the loss mask: bold green" if tty else "in the loss mask: [[...]]"
    for n, sample in enumerate(seen.picked, 1):
        print(f"--- sample {n}/{len(seen.picked)}: id {printable(sample.sample_id)}, {len(sample.input_ids)} tokens, "
              f"{int(sample.loss_mask.sum())} in the loss mask ({marker})")
        text = render_sample(sample_segments(tokenizer, sample.input_ids, sample.loss_mask), console)
        if text is not None:
            print(text if len(text) <= cfg.sample_chars else text[:cfg.sample_chars] + f" ... [{len(text)} chars]")


def print_plan(cfg: InspectConfig, target, seen: Seen) -> None:
    """The plan's estimate: batches, padding, what is stored and what it costs, the trainers it feeds, GPU and CPU time."""
    layer_ids, store_final, text_cfg = list(target.layer_ids), target.store_final, target.text_cfg
    est = estimate(seen.lengths, text_cfg, layer_ids, store_final, target.store_dtype, cfg.token_budget,
                   cfg.max_batch_rows, cfg.pad_multiple, cfg.window_rows, cfg.gpu_tokens_per_s,
                   cfg.storage_usd_per_tb_month, cfg.codec)
    print(f"plan: {est.batches} batches of <= {cfg.token_budget} tokens, {est.tokens} tokens, padding {est.padding:.2%} "
          f"({est.padded_tokens} computed)")
    print(seen.reuse.line(est.tokens, est.padded_tokens))
    print(f"  store: layers {layer_ids}{' + final' if store_final else ''} x {text_cfg.hidden_size} x {target.store_dtype}"
          + (f" + {cfg.codec}" if cfg.codec != "none" else "") + " = "
          f"{fmt_bytes(est.bytes_per_token)} a token -> {fmt_bytes(est.stored_bytes)}, "
          f"${est.storage_usd_month:,.2f} a month at ${cfg.storage_usd_per_tb_month:g}/TB-month")
    for line in precision_lines(target.store_dtype, cfg.compute_dtype, cfg.fp8_accumulation):
        print(line)
    can = feeds(layer_ids, store_final)
    cannot = [t for t in TARGETS if t not in can]
    print(f"  trainers: {', '.join(can)} (hsx export --for)"
          + (f"; not {', '.join(cannot)}: they need the final state (--layers {cfg.layers}+final)" if cannot else ""))
    print(f"  GPU: {est.gpu_hours:,.2f} GPU-hours at {est.tokens_per_s:,.0f} tokens/s ({est.rate_source})"
          + (f", ${est.gpu_hours * cfg.gpu_usd_per_hour:,.2f} at ${cfg.gpu_usd_per_hour:g}/GPU-hour"
             if cfg.gpu_usd_per_hour else ""))
    useful = est.tokens / max(est.padded_tokens, 1)
    print(f"  CPU: {est.padded_tokens / est.cpu.high / 3600:,.2f}-{est.padded_tokens / est.cpu.low / 3600:,.2f} hours at "
          f"~{est.cpu.low:,.0f}-{est.cpu.high:,.0f} computed tokens/s ({est.cpu.low * useful:,.0f}-"
          f"{est.cpu.high * useful:,.0f} useful at this plan's padding, the rate a worker logs); an estimate: "
          f"{est.cpu.source}")
