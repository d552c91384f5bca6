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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hsx import batchfile, heartbeat, layout, ledger, queues
from hsx.config import ProduceConfig
from hsx.dataset import DatasetError, fingerprint
from hsx.defaults import DEFAULT_PINNED_BUFFERS, MAX_PINNED_BYTES
from hsx.layers import resolve_layers
from hsx.manifest import RunLimits, build_manifest, check_same_run, config_hash, load_model_config
from hsx.planning import cut_batches, padding_fraction
from hsx.integrity import unmark_missing_done
from hsx.redisconn import connect
from hsx.errors import HsxError
from producer.tokenising import Sample, TokeniseReport, tokenise_dataset

log = logging.getLogger(__name__)
INPUT_UPLOAD_THREADS = 8


class PlanError(HsxError, RuntimeError):
    """The run cannot be planned; the message says why."""


@dataclass
class ProduceReport:
    run: str
    manifest: dict
    tokenise: TokeniseReport
    batches: int
    samples: int
    tokens: int
    padded_tokens: int
    already_done: int
    already_pending: int
    enqueued: int
    repaired: int = 0

    def lines(self) -> list[str]:
        t = self.tokenise
        out = [f"run {self.run}: {t.rows} rows read, {t.kept} samples kept, {t.truncated} truncated, "
               f"{t.dropped_overlong} dropped as over-long, {sum(t.rejected.values())} rejected",
               f"plan: {self.batches} batches, {self.tokens} tokens, padding {1 - self.tokens / max(self.padded_tokens, 1):.2%} "
               f"of {self.padded_tokens} computed tokens",
               f"queue: {self.enqueued} batches enqueued, {self.already_done} already done, {self.already_pending} already pending"
               + (f", {self.repaired} recorded done but missing from the store (re-enqueued)" if self.repaired else "")]
        for kind, count in t.rejected.most_common():
            out.append(f"  rejected {count} x {kind}")
        out.extend(f"  {example}" for example in t.examples)
        return out


def model_identity(model: str):
    """(text config, tokenizer, config hash) of the target model."""
    from transformers import AutoTokenizer

    config = load_model_config(model)
    return getattr(config, "text_config", None) or config, AutoTokenizer.from_pretrained(model), config_hash(config)


def _check_pinned_memory(cfg: ProduceConfig, width: int) -> None:
    """A GPU worker pins DEFAULT_PINNED_BUFFERS x token_budget x width values of host memory; refuse absurd budgets."""
    need = DEFAULT_PINNED_BUFFERS * cfg.token_budget * width * torch.finfo(getattr(torch, cfg.dtype)).bits // 8
    if need > MAX_PINNED_BYTES:
        raise PlanError(f"--token-budget {cfg.token_budget} needs {need / 2**30:.0f} GiB of pinned host memory per GPU "
                        f"worker ({DEFAULT_PINNED_BUFFERS} x budget x {width} values x {cfg.dtype}); at most "
                        f"{MAX_PINNED_BYTES // 2**30} GiB: lower --token-budget")


def _input_tensors(members: list[Sample]) -> dict[str, torch.Tensor]:
    lengths = [len(s.input_ids) for s in members]
    return {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in members])),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in members])),
        "cu_seqlens": torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int64),
    }


def produce(cfg: ProduceConfig) -> ProduceReport:
    # Everything that can be wrong with the settings is found before anything is created.
    layout.check_run_name(cfg.run)
    if cfg.overlong not in ("drop", "truncate"):
        raise PlanError(f"--overlong must be drop or truncate, got {cfg.overlong!r}")
    if not cfg.dataset.exists():
        raise DatasetError(f"dataset {cfg.dataset} does not exist (--dataset / HSX_DATASET)")
    cfg.store.check_writable()
    r = connect(cfg.redis_url)
    text_cfg, tokenizer, cfg_hash = model_identity(cfg.model)
    layer_ids, store_final = resolve_layers(cfg.layers, text_cfg.num_hidden_layers)
    _check_pinned_memory(cfg, text_cfg.hidden_size * (len(layer_ids) + store_final))
    store = cfg.store.open()

    log.info("fingerprinting %s", cfg.dataset)
    manifest = build_manifest(
        run=cfg.run, model=cfg.model, model_config_hash=cfg_hash, model_type=text_cfg.model_type,
        num_layers=text_cfg.num_hidden_layers, hidden_size=text_cfg.hidden_size, layer_preset=cfg.layers,
        layer_ids=layer_ids, store_final=store_final, dtype=cfg.dtype, max_length=cfg.max_length,
        overlong=cfg.overlong, token_budget=cfg.token_budget, pad_multiple=cfg.pad_multiple,
        max_batch_rows=cfg.max_batch_rows, batches_per_shard=cfg.batches_per_shard,
        dataset=str(cfg.dataset), dataset_fingerprint=fingerprint(cfg.dataset),
        chat_template_hash=hashlib.sha256(str(tokenizer.chat_template or "").encode()).hexdigest(),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        store_url=cfg.store.url, store=cfg.store.to_dict(),
        limits=RunLimits(cfg.max_attempts, cfg.lease_seconds).to_dict(),
    )
    existing = ledger.get_manifest(r, cfg.run)
    if existing is None:
        try:
            existing = json.loads(store.get_bytes(layout.manifest_key(cfg.run)))
        except KeyError:
            existing = None
    if existing is not None:
        check_same_run(existing, manifest, cfg.run)
        manifest["created"] = existing.get("created", manifest["created"])

    log.info("tokenising %s with %s's chat template", cfg.dataset, cfg.model)
    samples, tok_report = tokenise_dataset(cfg.dataset, cfg.model, cfg.max_length, cfg.overlong, cfg.tokenise_workers)
    if not samples:
        raise PlanError(f"{cfg.dataset}: no usable rows out of {tok_report.rows}; nothing to plan. "
                        + "; ".join(tok_report.examples[:5]))
    planned = cut_batches([len(s.input_ids) for s in samples], cfg.token_budget, cfg.max_batch_rows, cfg.pad_multiple)
    specs = []
    for index, batch in enumerate(planned):
        bid = layout.batch_id(index)
        specs.append(ledger.BatchSpec(
            batch_id=bid, index=index, shard=layout.shard_of(index, cfg.batches_per_shard),
            samples=len(batch.members), tokens=batch.tokens, padded=batch.padded, padded_len=batch.padded_len,
            sample_ids=[samples[i].sample_id for i in batch.members]))
    log.info("planned %d batches, padding %.2f%%", len(specs), 100 * padding_fraction(planned))

    repaired = unmark_missing_done(r, store, cfg.run) if existing is not None else []
    done = ledger.done_ids(r, cfg.run)
    _write_inputs(store, cfg.run, samples, planned, specs, done, manifest)
    totals = {"batches": len(specs), "samples": len(samples), "tokens": sum(s.tokens for s in specs),
              "padded_tokens": sum(s.padded for s in specs), "rows": tok_report.rows,
              "truncated": tok_report.truncated, "dropped_overlong": tok_report.dropped_overlong,
              "rejected": sum(tok_report.rejected.values())}
    store.put_bytes(layout.manifest_key(cfg.run), json.dumps(manifest, indent=2, sort_keys=True).encode())
    ledger.save_plan(r, cfg.run, manifest, specs, totals)

    enqueued, pending = 0, set()
    if cfg.enqueue:
        pending = queues.pending_extract(r, cfg.run)
        for host in heartbeat.read_hosts(r, cfg.run):
            pending |= queues.pending_upload(r, host, cfg.run)
        pipe = r.pipeline()
        for spec in specs:
            if spec.batch_id in done or spec.batch_id in pending:
                continue
            queues.enqueue_extract(r, cfg.run, spec.batch_id, pipeline=pipe)
            enqueued += 1
        pipe.execute()
    return ProduceReport(cfg.run, manifest, tok_report, len(specs), totals["samples"], totals["tokens"],
                         totals["padded_tokens"], len(done), len(pending), enqueued, len(repaired))


def _write_inputs(store, run, samples, planned, specs, done, manifest) -> None:
    """Put each batch's packed inputs in the store (skipping done batches and identical objects)."""

    def put(i: int) -> None:
        spec = specs[i]
        if spec.batch_id in done:
            return
        members = [samples[j] for j in planned[i].members]
        data = batchfile.to_bytes(_input_tensors(members), {
            "format": batchfile.INPUT_FORMAT, "run": run, "batch_id": spec.batch_id,
            "sample_ids": json.dumps(spec.sample_ids), "padded_len": str(spec.padded_len)})
        key = layout.input_key(run, spec.shard, spec.batch_id)
        head = store.head(key)
        if head is not None and head.size == len(data) and head.sha256 == hashlib.sha256(data).hexdigest():
            return
        store.put_bytes(key, data)

    with ThreadPoolExecutor(INPUT_UPLOAD_THREADS) as pool:
        for n, _ in enumerate(pool.map(put, range(len(specs))), 1):
            if n % 1000 == 0:
                log.info("wrote inputs of %d/%d batches", n, len(specs))
