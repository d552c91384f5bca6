"""Plan a run and enqueue its batches.

Re-running is safe: the plan is deterministic for the same dataset, model and
settings, inputs already in the store are not rewritten, and only batches
that are neither done nor pending get a job. A different manifest for an
existing run is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import redis
import torch

from hsx import life
from hsx.batch import INPUT_DIGEST_MISMATCH, INPUT_FORMAT, batch_bytes, check_store_dtype, hidden_bytes_per_token
from hsx.defaults import DEFAULT_PINNED_BUFFERS, MAX_PINNED_BYTES
from hsx.errors import HsxError
from hsx.fleet import check_eviction_policy
from hsx.layers import resolve_layers
from hsx.life import Rebuild, RunKeys, unmark_missing_done, write_index_if_complete
from hsx.monitor import Progress
from hsx.prep import (
    Sample,
    TokeniseReport,
    TokeniseSettings,
    Window,
    WindowTokeniser,
    check_budget,
    check_row_settings,
    cut_batches,
    default_workers,
    fingerprints,
    padding_fraction,
    resolve_dataset,
    resolve_model,
    resolve_store_url,
    weights_fingerprint,
)
from hsx.redisconn import connect, redact
from hsx.runspec import (
    Manifest,
    ProduceConfig,
    RunFacts,
    config_hash,
    load_model_config,
    plan_manifest,
    resumed_manifest,
    text_config,
)
from hsx.store import Store, check_store, layout
from producer import windows
from producer.runlock import ProducerLock
from producer.windows import WindowRecord

log = logging.getLogger(__name__)
INPUT_UPLOAD_THREADS = 8


class PlanError(HsxError, RuntimeError):
    """The run cannot be planned; the message says why."""


class RejectShareExceeded(PlanError):
    """More than the allowed share of rows was rejected; nothing is left on the queue."""


@dataclass
class ProduceReport:
    run: str
    manifest: Manifest
    tokenise: TokeniseReport
    batches: int
    samples: int
    tokens: int
    padded_tokens: int
    already_done: int
    already_pending: int
    enqueued: int
    repaired: int = 0
    windows: int = 0
    resumed_windows: int = 0
    rebuilt: int = 0
    planned_only: bool = False

    def lines(self) -> list[str]:
        t = self.tokenise
        out = [f"run {self.run}: {t.rows} rows read, {t.kept} samples kept, {t.truncated} truncated, "
               f"{t.dropped_overlong} dropped as over-long, {t.rejected_rows} rejected ({t.reject_share():.2%})",
               "rows by format: " + ", ".join(f"{k} {v}" for k, v in sorted(t.formats.items())),
               f"plan: {self.batches} batches, {self.tokens} tokens, padding {1 - self.tokens / max(self.padded_tokens, 1):.2%} "
               f"of {self.padded_tokens} computed tokens",
               f"windows: {self.windows}" + (f" ({self.resumed_windows} done by an earlier producer, skipped)"
                                             if self.resumed_windows else ""),
               f"queue: {self.enqueued} batches enqueued, {self.already_done} already done, {self.already_pending} already pending"
               + (f", {self.repaired} recorded done but missing from the store (re-enqueued)" if self.repaired else "")
               + (f", {self.rebuilt} recorded done from verified objects in the store (ledger rebuilt)"
                  if self.rebuilt else "")]
        if self.planned_only:
            out.append(f"planned only: no process enqueues run {self.run} until you start it with this `hsx produce` "
                       "command without --no-enqueue")
        for kind, count in t.rejected.most_common():
            out.append(f"  rejected {count} x {kind}")
        out.extend(f"  {example}" for example in t.examples)
        return out


def model_identity(model: str):
    """(text config, tokenizer, config hash) of the target model."""
    from transformers import AutoTokenizer

    config = load_model_config(model)
    return text_config(config), AutoTokenizer.from_pretrained(model), config_hash(config)


def _check_pinned_memory(token_budget: int, hidden_size: int, rows: int, store_dtype: str) -> None:
    """A GPU worker pins DEFAULT_PINNED_BUFFERS x token_budget x the bytes a token stores (Manifest.host_bytes_per_token);
    refuse absurd budgets."""
    per_token = hidden_bytes_per_token(hidden_size, rows, store_dtype)
    need = DEFAULT_PINNED_BUFFERS * token_budget * per_token
    if need > MAX_PINNED_BYTES:
        raise PlanError(f"--token-budget {token_budget} needs {need / 2**30:.0f} GiB of pinned host memory per GPU "
                        f"worker ({DEFAULT_PINNED_BUFFERS} x budget x {per_token} bytes a token of {store_dtype}); at "
                        f"most {MAX_PINNED_BYTES // 2**30} GiB: lower --token-budget")


def _input_tensors(members: list[Sample]) -> dict[str, torch.Tensor]:
    lengths = [len(s.input_ids) for s in members]
    return {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in members])),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in members])),
        "cu_seqlens": torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int64),
    }


def produce(cfg: ProduceConfig, on_event: Callable[[str, int], None] | None = None) -> ProduceReport:
    """Plan and enqueue the run window by window: check, identify, resume, plan windows, seal.
    ``on_event(name, window)`` sees "tokenised", "enqueued" and "recorded" as each window gets there
    (tests and progress)."""
    cfg, r = check(cfg)
    planned, named_fingerprint = identify(cfg)
    store = cfg.store.open()
    existing = life.get_manifest(r, cfg.run) or Manifest.load(store, cfg.run)
    manifest = resumed_manifest(existing, planned, named_fingerprint)
    with ProducerLock(r, cfg.run, cfg.lock_wait_seconds) as lock:
        planning = resume(_Planning(r, store, cfg, lock), resumed=existing is not None)
        plan_windows(planning, manifest, on_event or (lambda name, window: None))
        seal(planning, manifest)
    return planning.produce_report(manifest)


def check(cfg: ProduceConfig) -> tuple[ProduceConfig, redis.Redis]:
    """Everything that can be wrong with the settings, Redis and the store, found before anything is created.
    Returns the settings with their paths resolved, and the Redis client."""
    layout.check_run_name(cfg.run)
    check_row_settings(cfg.overlong, cfg.max_reject_share)
    check_budget(cfg.max_length, cfg.token_budget, cfg.pad_multiple)
    # Paths are resolved once, here: the manifest holds them absolute for roles started anywhere (DESIGN rule 8).
    cfg = replace(cfg, dataset=resolve_dataset(cfg.dataset), model=resolve_model(cfg.model),
                  store=replace(cfg.store, url=resolve_store_url(cfg.store.url)))
    cfg.store.check_writable()
    r = connect(cfg.redis_url)
    check_eviction_policy(r, f"Redis at {redact(cfg.redis_url)}")
    check_store(cfg.store, "produce", run=cfg.run)  # an S3 store answers within 10 s, or one line says which setting
    return cfg, r


def identify(cfg: ProduceConfig) -> tuple[Manifest, str]:
    """The run's manifest as planned now, from what the model, the layers and the dataset are; and the
    dataset's fingerprint as older hsx computed it (a run they planned resumes with it)."""
    text_cfg, tokenizer, cfg_hash = model_identity(cfg.model)
    layer_ids, store_final = resolve_layers(cfg.layers, text_cfg.num_hidden_layers)
    store_dtype = check_store_dtype(cfg.store_dtype or cfg.dtype)   # the one place a run's store dtype is chosen
    _check_pinned_memory(cfg.token_budget, text_cfg.hidden_size, len(layer_ids) + store_final, store_dtype)
    log.info("fingerprinting %s", cfg.dataset)
    content_fingerprint, named_fingerprint = fingerprints(cfg.dataset)
    facts = RunFacts(
        model_config_hash=cfg_hash, model_type=text_cfg.model_type, num_layers=text_cfg.num_hidden_layers,
        hidden_size=text_cfg.hidden_size, layer_ids=tuple(layer_ids), store_final=store_final,
        store_dtype=store_dtype, dataset_fingerprint=content_fingerprint,
        chat_template_hash=hashlib.sha256(str(tokenizer.chat_template or "").encode()).hexdigest(),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        model_weights=weights_fingerprint(cfg.model))
    return plan_manifest(cfg, facts), named_fingerprint


@dataclass
class _Planning:
    """A run being planned under its producer lock: what resuming found, and what planning added since."""

    r: redis.Redis
    store: Store
    cfg: ProduceConfig
    lock: ProducerLock
    done: set[str] = field(default_factory=set)      # batch ids the ledger holds done (gains those rebuilt)
    pending: set[str] = field(default_factory=set)   # batch ids on a queue (extract or upload); gains those enqueued
    rebuild: Rebuild | None = None   # a re-run: stored objects the ledger lacks are checked and recorded done
    suspect: frozenset[str] = frozenset()   # batches whose inputs a worker found corrupt: checked by their bytes
    seen: set[str] = field(default_factory=set)      # sample ids of the resumed windows (duplicate check)
    planned_only: bool = False
    repaired: int = 0                # recorded done but missing from the store: re-enqueued
    first_pending: int = 0           # batches pending when this producer started
    resumed_windows: int = 0         # windows an earlier producer recorded
    new_windows: int = 0             # windows this producer recorded
    report: TokeniseReport = field(default_factory=TokeniseReport)
    batches: int = 0
    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    enqueued: int = 0
    manifest_saved: bool = False

    def add(self, rec: WindowRecord, resumed: bool) -> None:
        self.batches += rec.batches
        self.samples += rec.samples
        self.tokens += rec.tokens
        self.padded_tokens += rec.padded_tokens
        if resumed:
            self.report.merge(rec.report)
            self.resumed_windows += 1
            self.manifest_saved = True
        else:
            self.new_windows += 1

    def totals(self, planning: int) -> dict[str, int]:
        """The run's totals (Redis ``hsx:<run>:totals``); ``planning``: 1 while windows are still to come."""
        report = self.report
        return {"batches": self.batches, "samples": self.samples, "tokens": self.tokens,
                "padded_tokens": self.padded_tokens, "planning": planning, "rows": report.rows,
                "truncated": report.truncated, "dropped_overlong": report.dropped_overlong,
                "rejected": report.rejected_rows}

    def produce_report(self, manifest: Manifest) -> ProduceReport:
        return ProduceReport(self.cfg.run, manifest, self.report, self.batches, self.samples, self.tokens,
                             self.padded_tokens, len(self.done), self.first_pending, self.enqueued, self.repaired,
                             windows=self.resumed_windows + self.new_windows, resumed_windows=self.resumed_windows,
                             rebuilt=len(self.rebuild.rebuilt) if self.rebuild is not None else 0,
                             planned_only=self.planned_only)


def resume(planning: _Planning, resumed: bool) -> _Planning:
    """What is already true of the run: the ledger's done and pending batches, the windows an earlier producer
    recorded (their batches neither done nor pending are enqueued again). A fresh run finds none of it."""
    r, run = planning.r, planning.cfg.run
    planning.planned_only = _mark_planned_only(r, planning.cfg, new_run=not resumed)
    planning.repaired = len(unmark_missing_done(r, planning.store, run)) if resumed else 0
    planning.done = life.done_ids(r, run)
    # A re-run: the store is the second copy of the truth (DESIGN rule 2). Objects not in the ledger
    # (all of them after Redis lost the run) are checked and recorded done window by window.
    planning.rebuild = Rebuild(r, planning.store, run, planning.done) if resumed else None
    planning.pending = life.pending_extract(r, run)
    for host in life.read_hosts(r, run):
        planning.pending |= life.pending_upload(r, host, run)
    planning.first_pending = len(planning.pending)
    records, planning.suspect = _replan_bad_inputs(r, run, windows.load(r, run))
    for rec in records:
        planning.add(rec, resumed=True)
    if records:
        earlier = [spec for spec in life.all_specs(r, run).values() if spec.index < planning.batches]
        planning.seen = {sid for spec in earlier for sid in spec.sample_ids}
        if planning.rebuild is not None:
            planning.rebuild.check(earlier)
        planning.enqueued += _enqueue(planning, sorted(earlier, key=lambda s: s.index))
        log.info("run %s: windows 0-%d were planned by an earlier producer (%d batches; %d of them re-enqueued, "
                 "neither done nor pending)", run, len(records) - 1, planning.batches, planning.enqueued)
    return planning


def plan_windows(planning: _Planning, manifest: Manifest, event: Callable[[str, int], None]) -> None:
    """Tokenise the windows after the resumed ones; plan, write, enqueue and record each as it comes."""
    cfg = planning.cfg
    settings = TokeniseSettings(cfg.model, cfg.max_length, cfg.overlong, cfg.template_kwargs, cfg.columns)
    workers = cfg.tokenise_workers or default_workers(cfg.dataset)
    log.info("tokenising %s with %s's chat template on %d processes, %d rows a window",
             cfg.dataset, cfg.model, workers, cfg.window_rows)
    progress = Progress(f"tokenise {cfg.dataset.name} for run {cfg.run}", None, "rows")  # bar or log line
    with WindowTokeniser(cfg.dataset, settings, workers, cfg.window_rows, first_window=planning.resumed_windows,
                         seen=planning.seen, on_event=event, on_rows=progress.advance) as tokenised, progress:
        for window in tokenised:
            planning.report.merge(window.report)
            _check_reject_share(planning)
            if not window.samples:
                continue
            if not planning.manifest_saved:
                manifest.save(planning.store)
                planning.manifest_saved = True
            rec = _plan_window(planning, manifest, window)
            event("enqueued", window.number)
            windows.record(planning.r, cfg.run, window.number, rec)
            planning.add(rec, resumed=False)
            planning.enqueued += rec.enqueued
            life.save_plan(planning.r, cfg.run, manifest, [], planning.totals(planning=1))
            event("recorded", window.number)
            log.info("window %d: %d rows, %d batches (padding %.2f%%), %d enqueued; %d rows so far",
                     window.number, window.report.rows, rec.batches, 100 * rec.padding, rec.enqueued,
                     planning.report.rows)


def seal(planning: _Planning, manifest: Manifest) -> None:
    """The plan is whole: the manifest and the final totals are written; on a re-run, the failures of batches
    now done are dropped and the run's index is written if every batch is done."""
    r, run = planning.r, planning.cfg.run
    if not planning.batches:
        raise PlanError(f"{planning.cfg.dataset}: no usable rows out of {planning.report.rows}; nothing to plan. "
                        + "; ".join(planning.report.examples[:5]))
    manifest.save(planning.store)
    life.save_plan(r, run, manifest, [], planning.totals(planning=0))
    if planning.rebuild is not None:
        settled = life.drop_failures_of_done(r, run)
        if settled:
            log.warning("run %s: %d batches are done but were still listed as failed or dead letters (%s); "
                        "those records are dropped", run, len(settled), ", ".join(settled[:10]))
    if planning.rebuild is not None and planning.rebuild.rebuilt:
        write_index_if_complete(r, planning.store, run)


def _mark_planned_only(r, cfg: ProduceConfig, new_run: bool) -> bool:
    """``--no-enqueue`` on a new (or still plan-only) run marks it planned only, before any of its plan is in
    Redis: no reconciler of any role enqueues it (hsx/life/reconcile.py) until a `hsx produce` without the flag
    starts it, which removes the mark. A run already started stays started. True if the run is planned only."""
    key = RunKeys(cfg.run).planned_only
    if cfg.enqueue:
        r.delete(key)
        return False
    if new_run or r.exists(key):
        r.set(key, "1")
        return True
    return False


def _replan_bad_inputs(r, run: str, records: list[WindowRecord]) -> tuple[list[WindowRecord], frozenset[str]]:
    """Windows from the first one holding a batch whose worker found its inputs corrupt (a failure or
    dead letter naming the digest mismatch) are planned again: same batch ids, inputs rewritten.

    Returns the window records kept and those batches: their input objects are checked by their bytes
    (the store's sha256 metadata is what the producer wrote, not what the object holds now)."""
    bad = [bid for rec in (*life.failures(r, run).items(), *life.dead_letters(r, run).items())
           for bid in [rec[0]] if INPUT_DIGEST_MISMATCH in str(rec[1].get("last_error", ""))]
    indexes = [int(bid[1:]) for bid in bad if bid[1:].isdigit()]
    if not indexes or not records:
        return records, frozenset(bad)
    first = min(indexes)
    keep = [rec for rec in records if rec.end_batch <= first]
    windows.forget_from(r, run, len(keep))
    log.warning("inputs of %s were found corrupt by workers: planning windows %d-%d again to rewrite them",
                sorted(bad)[:10], len(keep), len(records) - 1)
    return keep, frozenset(bad)


def _check_reject_share(planning: _Planning) -> None:
    """Fail the run, with nothing left on the queue, once more than the allowed share of rows is rejected."""
    report, cfg = planning.report, planning.cfg
    if report.reject_share() <= cfg.max_reject_share:
        return
    withdrawn = windows.withdraw(planning.r, cfg.run) if planning.batches else 0
    reasons = ", ".join(f"{code} {n}" for code, n in report.rejected.most_common())
    raise RejectShareExceeded(
        f"{report.rejected_rows} of the {report.rows} rows read so far were rejected ({report.reject_share():.2%}), "
        f"more than --max-reject-share {cfg.max_reject_share:.2%}; stopped with nothing on the queue"
        + (f" ({withdrawn} batches of earlier windows taken back)" if withdrawn else "")
        + f". Rejected by reason: {reasons}. Examples:\n  " + "\n  ".join(report.examples[:10])
        + "\nFix the rows, map their columns (--columns), or raise --max-reject-share if this loss is intended.")


def _plan_window(planning: _Planning, manifest: Manifest, window: Window) -> WindowRecord:
    """Cut, write inputs, save the plan and enqueue one window's batches; the window's record."""
    cfg, samples, first_batch = planning.cfg, window.samples, planning.batches
    planned = cut_batches([len(s.input_ids) for s in samples], cfg.token_budget, cfg.max_batch_rows, cfg.pad_multiple)
    specs = []
    for offset, batch in enumerate(planned):
        index = first_batch + offset
        specs.append(life.BatchSpec(
            batch_id=layout.batch_id(index), index=index, shard=layout.shard_of(index, cfg.batches_per_shard),
            samples=len(batch.members), tokens=batch.tokens, padded=batch.padded, padded_len=batch.padded_len,
            sample_ids=[samples[i].sample_id for i in batch.members]))
    if planning.rebuild is not None:
        planning.rebuild.check(specs)
    specs = _write_inputs(planning.store, cfg.run, samples, planned, specs, planning.done, planning.suspect)
    life.save_plan(planning.r, cfg.run, manifest, specs, {"planning": 1})
    enqueued = _enqueue(planning, specs)
    return WindowRecord(first_batch=first_batch, batches=len(specs), samples=len(samples),
                        tokens=sum(s.tokens for s in specs), padded_tokens=sum(s.padded for s in specs),
                        padding=padding_fraction(planned), enqueued=enqueued, report=window.report)


def _enqueue(planning: _Planning, specs: list[life.BatchSpec]) -> int:
    """Enqueue the batches neither done nor pending, in one transaction that fails if the lock changed hands."""
    if not planning.cfg.enqueue:
        return 0
    todo = [spec for spec in specs if spec.batch_id not in planning.done and spec.batch_id not in planning.pending]
    if todo:
        pipe = planning.lock.guarded_pipeline()
        life.enqueue(planning.r, planning.cfg.run, [spec.batch_id for spec in todo], first=True, pipe=pipe)
        planning.lock.execute(pipe)
        planning.pending.update(spec.batch_id for spec in todo)
    return len(todo)


def _write_inputs(store: Store, run: str, samples: list[Sample], planned: list, specs: list[life.BatchSpec],
                  done: set[str], suspect: frozenset[str]) -> list[life.BatchSpec]:
    """Put each batch's packed inputs in the store (skipping done batches and identical objects).

    An object counts as identical by its size and the SHA-256 the store reports (S3: the metadata written
    with it), except for ``suspect`` batches (a worker found their inputs corrupt): those objects are read
    back and hashed, since corruption at rest leaves the metadata as it was.
    Returns the specs with ``input_sha256`` set: workers check the inputs they read against it.
    """

    def put(i: int) -> life.BatchSpec:
        spec = specs[i]
        members = [samples[j] for j in planned[i].members]
        data = batch_bytes(_input_tensors(members), {
            "format": INPUT_FORMAT, "run": run, "batch_id": spec.batch_id,
            "sample_ids": json.dumps(spec.sample_ids), "padded_len": str(spec.padded_len)})
        sha = hashlib.sha256(data).hexdigest()
        if spec.batch_id not in done:
            key = layout.input_key(run, spec.shard, spec.batch_id)
            head = store.head(key)
            if head is None or head.size != len(data) or head.sha256 != sha or (
                    spec.batch_id in suspect and _stored_sha256(store, key) != sha):
                store.put_bytes(key, data)
                if spec.batch_id in suspect:
                    log.warning("rewrote the input object %s of %s (its bytes differed from the plan's)",
                                store.url(key), spec.batch_id)
        return replace(spec, input_sha256=sha)

    out = []
    with ThreadPoolExecutor(INPUT_UPLOAD_THREADS) as pool:
        for n, spec in enumerate(pool.map(put, range(len(specs))), 1):
            out.append(spec)
            if n % 1000 == 0:
                log.info("wrote inputs of %d/%d batches", n, len(specs))
    return out


def _stored_sha256(store, key: str) -> str | None:
    """SHA-256 of the object's bytes as the store returns them now (None if it is gone)."""
    try:
        return hashlib.sha256(store.get_bytes(key)).hexdigest()
    except KeyError:
        return None
