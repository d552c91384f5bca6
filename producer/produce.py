"""Plan a run and enqueue its batches.

Re-running is safe: the plan is deterministic for the same dataset, model and
settings, inputs already in the store are not rewritten, and only batches
that are neither done nor pending get a job. A different manifest for an
existing run is refused.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np
import torch

from hsx import life
from hsx.batch import INPUT_DIGEST_MISMATCH, InputsMeta, batch_bytes, check_codec, check_store_dtype, hidden_bytes_per_token
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
    RunLimits,
    check_compute_dtype,
    check_fp8_accumulation,
    check_same_run,
    config_hash,
    load_model_config,
    new_manifest,
    text_config,
)
from hsx.store import check_store, layout
from producer import windows
from producer.runlock import ProducerLock

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
    """Plan and enqueue the run window by window. ``on_event(name, window)`` sees "tokenised",
    "enqueued" and "recorded" as each window gets there (tests and progress)."""
    # Everything that can be wrong with the settings is found before anything is created.
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
    event = on_event or (lambda name, window: None)
    text_cfg, tokenizer, cfg_hash = model_identity(cfg.model)
    layer_ids, store_final = resolve_layers(cfg.layers, text_cfg.num_hidden_layers)
    store_dtype = check_store_dtype(cfg.store_dtype or cfg.dtype)   # the one place a run's store dtype is chosen
    _check_pinned_memory(cfg.token_budget, text_cfg.hidden_size, len(layer_ids) + store_final, store_dtype)
    store = cfg.store.open()

    log.info("fingerprinting %s", cfg.dataset)
    content_fingerprint, named_fingerprint = fingerprints(cfg.dataset)
    manifest = new_manifest(
        run=cfg.run, model=cfg.model, model_config_hash=cfg_hash, model_type=text_cfg.model_type,
        num_layers=text_cfg.num_hidden_layers, hidden_size=text_cfg.hidden_size, layer_preset=cfg.layers,
        layer_ids=tuple(layer_ids), store_final=store_final, dtype=cfg.dtype, max_length=cfg.max_length,
        store_dtype=store_dtype, codec=check_codec(cfg.codec),
        compute_dtype=check_compute_dtype(cfg.compute_dtype),
        fp8_accumulation=check_fp8_accumulation(cfg.fp8_accumulation, cfg.compute_dtype),
        overlong=cfg.overlong, token_budget=cfg.token_budget, pad_multiple=cfg.pad_multiple,
        max_batch_rows=cfg.max_batch_rows, batches_per_shard=cfg.batches_per_shard, window_rows=cfg.window_rows,
        dataset=str(cfg.dataset), dataset_fingerprint=content_fingerprint,
        chat_template_hash=hashlib.sha256(str(tokenizer.chat_template or "").encode()).hexdigest(),
        template_kwargs=MappingProxyType(dict(cfg.template_kwargs or {})),
        columns=MappingProxyType(cfg.columns.to_dict() if cfg.columns is not None else {}),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        store_url=cfg.store.url, store=cfg.store, limits=RunLimits(cfg.max_attempts, cfg.lease_seconds),
        model_weights=weights_fingerprint(cfg.model), incarnation=uuid.uuid4().hex,
    )
    existing = life.get_manifest(r, cfg.run) or Manifest.load(store, cfg.run)
    if existing is not None:
        if existing.dataset_fingerprint == named_fingerprint:  # a run planned when the name counted
            manifest = replace(manifest, dataset_fingerprint=named_fingerprint)
        check_same_run(existing, manifest)
        if not existing.model_weights and manifest.model_weights:
            log.warning("run %s was planned by an hsx that did not fingerprint the weights: recording %s's (%s) from "
                        "now on; batches done before were not checked against it", cfg.run, cfg.model,
                        manifest.model_weights)
        # The same run resumed: its incarnation stays (a run planned by an older hsx keeps none).
        manifest = replace(manifest, created=existing.created, incarnation=existing.incarnation,
                           model_weights=manifest.model_weights or existing.model_weights)

    with ProducerLock(r, cfg.run, cfg.lock_wait_seconds) as lock:
        planned_only = _mark_planned_only(r, cfg, new_run=existing is None)
        repaired = unmark_missing_done(r, store, cfg.run) if existing is not None else []
        done = life.done_ids(r, cfg.run)
        # A re-run: the store is the second copy of the truth (DESIGN rule 2). Objects not in the ledger
        # (all of them after Redis lost the run) are checked and recorded done window by window.
        rebuild = Rebuild(r, store, cfg.run, done) if existing is not None else None
        pending = life.pending_extract(r, cfg.run)
        for host in life.read_hosts(r, cfg.run):
            pending |= life.pending_upload(r, host, cfg.run)
        records, suspect = _replan_bad_inputs(r, cfg.run, windows.load(r, cfg.run))
        state = _State(report=TokeniseReport(), totals=dict.fromkeys(TOTAL_FIELDS, 0), first_pending=len(pending))
        for rec in records:
            state.add_record(rec)
        seen: set[str] = set()
        if records:
            earlier = [spec for spec in life.all_specs(r, cfg.run).values() if spec.index < state.totals["batches"]]
            seen = {sid for spec in earlier for sid in spec.sample_ids}
            if rebuild is not None:
                rebuild.check(earlier)
            state.enqueued += _enqueue(r, cfg, sorted(earlier, key=lambda s: s.index), done, pending, lock)
            log.info("run %s: windows 0-%d were planned by an earlier producer (%d batches; %d of them re-enqueued, "
                     "neither done nor pending)", cfg.run, len(records) - 1, state.totals["batches"], state.enqueued)
        settings = TokeniseSettings(cfg.model, cfg.max_length, cfg.overlong, cfg.template_kwargs, cfg.columns)
        workers = cfg.tokenise_workers or default_workers(cfg.dataset)
        log.info("tokenising %s with %s's chat template on %d processes, %d rows a window",
                 cfg.dataset, cfg.model, workers, cfg.window_rows)
        progress = Progress(f"tokenise {cfg.dataset.name} for run {cfg.run}", None, "rows")  # bar or log line
        with WindowTokeniser(cfg.dataset, settings, workers, cfg.window_rows, first_window=len(records),
                             seen=seen, on_event=event, on_rows=progress.advance) as tokenised, progress:
            for window in tokenised:
                state.report.merge(window.report)
                _check_reject_share(r, cfg, state)
                if not window.samples:
                    continue
                if not state.manifest_saved:
                    manifest.save(store)
                    state.manifest_saved = True
                rec = _plan_window(r, store, cfg, manifest, window, state.totals["batches"], done, pending, lock,
                                   rebuild, suspect)
                event("enqueued", window.number)
                rec["report"] = window.report.to_dict()
                windows.record(r, cfg.run, window.number, rec)
                state.add_record(rec, report=False)
                state.enqueued += rec["enqueued"]
                life.save_plan(r, cfg.run, manifest, [], {**state.totals, "planning": 1, **_row_totals(state.report)})
                event("recorded", window.number)
                log.info("window %d: %d rows, %d batches (padding %.2f%%), %d enqueued; %d rows so far",
                         window.number, window.report.rows, rec["batches"], 100 * rec["padding"], rec["enqueued"],
                         state.report.rows)
        if not state.totals["batches"]:
            raise PlanError(f"{cfg.dataset}: no usable rows out of {state.report.rows}; nothing to plan. "
                            + "; ".join(state.report.examples[:5]))
        manifest.save(store)
        life.save_plan(r, cfg.run, manifest, [], {**state.totals, "planning": 0, **_row_totals(state.report)})
        if rebuild is not None:
            settled = life.drop_failures_of_done(r, cfg.run)
            if settled:
                log.warning("run %s: %d batches are done but were still listed as failed or dead letters (%s); "
                            "those records are dropped", cfg.run, len(settled), ", ".join(settled[:10]))
        if rebuild is not None and rebuild.rebuilt:
            write_index_if_complete(r, store, cfg.run)
    t = state.totals
    return ProduceReport(cfg.run, manifest, state.report, t["batches"], t["samples"], t["tokens"], t["padded_tokens"],
                         len(done), state.first_pending, state.enqueued, len(repaired), windows=len(records) + state.new_windows,
                         resumed_windows=len(records), rebuilt=len(rebuild.rebuilt) if rebuild is not None else 0,
                         planned_only=planned_only)


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


TOTAL_FIELDS = ("batches", "samples", "tokens", "padded_tokens")


def _replan_bad_inputs(r, run: str, records: list[dict]) -> tuple[list[dict], frozenset[str]]:
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
    keep = [rec for rec in records if rec["first_batch"] + rec["batches"] <= first]
    windows.forget_from(r, run, len(keep))
    log.warning("inputs of %s were found corrupt by workers: planning windows %d-%d again to rewrite them",
                sorted(bad)[:10], len(keep), len(records) - 1)
    return keep, frozenset(bad)


@dataclass
class _State:
    report: TokeniseReport
    totals: dict
    first_pending: int
    enqueued: int = 0
    new_windows: int = 0
    manifest_saved: bool = False

    def add_record(self, rec: dict, report: bool = True) -> None:
        for k in TOTAL_FIELDS:
            self.totals[k] += rec[k]
        if report:
            self.report.merge(TokeniseReport.from_dict(rec["report"]))
            self.manifest_saved = True
        else:
            self.new_windows += 1


def _row_totals(report: TokeniseReport) -> dict[str, int]:
    return {"rows": report.rows, "truncated": report.truncated, "dropped_overlong": report.dropped_overlong,
            "rejected": report.rejected_rows}


def _check_reject_share(r, cfg: ProduceConfig, state: _State) -> None:
    """Fail the run, with nothing left on the queue, once more than the allowed share of rows is rejected."""
    report = state.report
    if report.reject_share() <= cfg.max_reject_share:
        return
    withdrawn = windows.withdraw(r, cfg.run) if state.totals["batches"] else 0
    reasons = ", ".join(f"{code} {n}" for code, n in report.rejected.most_common())
    raise RejectShareExceeded(
        f"{report.rejected_rows} of the {report.rows} rows read so far were rejected ({report.reject_share():.2%}), "
        f"more than --max-reject-share {cfg.max_reject_share:.2%}; stopped with nothing on the queue"
        + (f" ({withdrawn} batches of earlier windows taken back)" if withdrawn else "")
        + f". Rejected by reason: {reasons}. Examples:\n  " + "\n  ".join(report.examples[:10])
        + "\nFix the rows, map their columns (--columns), or raise --max-reject-share if this loss is intended.")


def _plan_window(r, store, cfg: ProduceConfig, manifest: Manifest, window, first_batch: int, done: set[str],
                 pending: set[str], lock: ProducerLock, rebuild: Rebuild | None = None,
                 suspect: frozenset[str] = frozenset()) -> dict:
    """Cut, write inputs, save the plan and enqueue one window's batches; the window's record."""
    samples = window.samples
    planned = cut_batches([len(s.input_ids) for s in samples], cfg.token_budget, cfg.max_batch_rows, cfg.pad_multiple)
    specs = []
    for offset, batch in enumerate(planned):
        index = first_batch + offset
        specs.append(life.BatchSpec(
            batch_id=layout.batch_id(index), index=index, shard=layout.shard_of(index, cfg.batches_per_shard),
            samples=len(batch.members), tokens=batch.tokens, padded=batch.padded, padded_len=batch.padded_len,
            sample_ids=[samples[i].sample_id for i in batch.members]))
    if rebuild is not None:
        rebuild.check(specs)
    specs = _write_inputs(store, cfg.run, samples, planned, specs, done, suspect)
    life.save_plan(r, cfg.run, manifest, specs, {"planning": 1})
    enqueued = _enqueue(r, cfg, specs, done, pending, lock)
    return {"first_batch": first_batch, "batches": len(specs), "samples": len(samples),
            "tokens": sum(s.tokens for s in specs), "padded_tokens": sum(s.padded for s in specs),
            "padding": padding_fraction(planned), "enqueued": enqueued}


def _enqueue(r, cfg: ProduceConfig, specs: list[life.BatchSpec], done: set[str], pending: set[str],
             lock: ProducerLock) -> int:
    """Enqueue the batches neither done nor pending, in one transaction that fails if the lock changed hands."""
    if not cfg.enqueue:
        return 0
    todo = [spec for spec in specs if spec.batch_id not in done and spec.batch_id not in pending]
    if todo:
        pipe = lock.guarded_pipeline()
        life.enqueue(r, cfg.run, [spec.batch_id for spec in todo], first=True, pipe=pipe)
        lock.execute(pipe)
        pending.update(spec.batch_id for spec in todo)
    return len(todo)


def _write_inputs(store, run, samples, planned, specs, done, suspect: frozenset[str]) -> list[life.BatchSpec]:
    """Put each batch's packed inputs in the store (skipping done batches and identical objects).

    An object counts as identical by its size and the SHA-256 the store reports (S3: the metadata written
    with it), except for ``suspect`` batches (a worker found their inputs corrupt): those objects are read
    back and hashed, since corruption at rest leaves the metadata as it was.
    Returns the specs with ``input_sha256`` set: workers check the inputs they read against it.
    """

    def put(i: int) -> life.BatchSpec:
        spec = specs[i]
        members = [samples[j] for j in planned[i].members]
        data = batch_bytes(_input_tensors(members), InputsMeta(
            run=run, batch_id=spec.batch_id, sample_ids=tuple(spec.sample_ids), padded_len=spec.padded_len).to_metadata())
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
