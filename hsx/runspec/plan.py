"""A run's manifest, built from `hsx produce`'s settings and what the producer found about its inputs.

The producer finds the facts (the model's config and tokenizer, the layers, the dataset's and the weights'
fingerprints: ``RunFacts``); ``plan_manifest`` turns the settings and those facts into the Manifest, and
``resumed_manifest`` reconciles it with the manifest of a run that already exists (refused if it differs).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from types import MappingProxyType

from hsx.batch import check_codec
from hsx.defaults import DEFAULT_PREFIX_CACHE_BUDGETS, MAX_PREFIX_STORED_BUDGETS, MAX_TOKEN_BUDGET, PREFIX_REUSE
from hsx.errors import ConfigError
from hsx.runspec.compute import check_compute_dtype, check_fp8_accumulation
from hsx.runspec.config import ProduceConfig
from hsx.runspec.manifest import Manifest, RunLimits, check_same_run, new_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunFacts:
    """What the producer found about a run's inputs: the manifest records them beside the settings."""

    model_config_hash: str      # config_hash() of the model
    model_type: str             # the text config's model_type
    num_layers: int             # decoder layers of the target
    hidden_size: int            # H
    layer_ids: tuple[int, ...]  # resolved from --layers, low to high
    store_final: bool           # --layers asked for the final (normed) state
    store_dtype: str            # checked: what batch files hold
    dataset_fingerprint: str    # of the dataset's content (hsx.prep.fingerprints)
    chat_template_hash: str     # SHA-256 of the tokenizer's chat template ("" template: of "")
    pad_token_id: int           # the tokenizer's, 0 if it has none
    model_weights: str          # weights_fingerprint() of the model's weight files
    mixture: tuple = ()         # a mixture's sources as the manifest keeps them (hsx.prep.Mixture.records)
    prefix_stored_budgets: int = 1  # --prefix-stored-budgets resolved (hsx.runspec.identity.fit_stored_budgets)


def plan_manifest(cfg: ProduceConfig, facts: RunFacts) -> Manifest:
    """The manifest of a run planned now from ``cfg`` (paths already resolved) and ``facts``, with a new
    incarnation. The codec and compute settings are checked here (one line naming the setting)."""
    return new_manifest(
        run=cfg.run, model=cfg.model, model_config_hash=facts.model_config_hash, model_type=facts.model_type,
        num_layers=facts.num_layers, hidden_size=facts.hidden_size, layer_preset=cfg.layers,
        layer_ids=tuple(facts.layer_ids), store_final=facts.store_final, dtype=cfg.dtype, max_length=cfg.max_length,
        store_dtype=facts.store_dtype, codec=check_codec(cfg.codec),
        compute_dtype=check_compute_dtype(cfg.compute_dtype),
        fp8_accumulation=check_fp8_accumulation(cfg.fp8_accumulation, cfg.compute_dtype),
        overlong=cfg.overlong, token_budget=cfg.token_budget, pad_multiple=cfg.pad_multiple,
        max_batch_rows=cfg.max_batch_rows, batches_per_shard=cfg.batches_per_shard, window_rows=cfg.window_rows,
        dataset=str(cfg.dataset), dataset_fingerprint=facts.dataset_fingerprint,
        chat_template_hash=facts.chat_template_hash,
        template_kwargs=MappingProxyType(dict(cfg.template_kwargs or {})),
        columns=MappingProxyType(cfg.columns.to_dict() if cfg.columns is not None else {}),
        pad_token_id=facts.pad_token_id, store_url=cfg.store.url, store=cfg.store,
        limits=RunLimits(cfg.max_attempts, cfg.lease_seconds), model_weights=facts.model_weights,
        incarnation=uuid.uuid4().hex, mixture=tuple(MappingProxyType(s) for s in facts.mixture),
        per_turn=bool(cfg.per_turn), **prefix_settings(cfg, facts),
    )


PREFIX_EXACT_MODEL_TYPES = ("qwen3", "qwen3_5_text", "qwen3_5")   # shown equal to lone forwards: tests/test_prefix_reuse.py


def stored_tokens(budgets: int, token_budget: int) -> int:
    """The manifest's ``prefix_stored_tokens`` for ``--prefix-stored-budgets``: 0 for one budget (as runs planned
    before it was recorded), else the tokens; ConfigError naming the flag where it is out of bounds."""
    if not 1 <= budgets <= MAX_PREFIX_STORED_BUDGETS:
        raise ConfigError(f"--prefix-stored-budgets {budgets}: expected 1 to {MAX_PREFIX_STORED_BUDGETS}")
    if budgets * token_budget > MAX_TOKEN_BUDGET:
        raise ConfigError(f"--prefix-stored-budgets {budgets} x --token-budget {token_budget} = "
                          f"{budgets * token_budget} tokens a batch stores, more than {MAX_TOKEN_BUDGET}: lower either")
    return 0 if budgets == 1 else budgets * token_budget


def prefix_settings(cfg: ProduceConfig, facts: RunFacts) -> dict:
    """The manifest's prefix fields for ``--prefix-reuse`` (hsx/prep/prefixplan.py): auto is on where reuse is
    shown exact (the model types above), said in one line where it is not."""
    if cfg.prefix_reuse not in PREFIX_REUSE:
        raise ValueError(f"--prefix-reuse {cfg.prefix_reuse!r}: expected one of {', '.join(PREFIX_REUSE)}")
    if cfg.prefix_reuse == "off":
        return {"prefix_reuse": "off"}
    if facts.model_type not in PREFIX_EXACT_MODEL_TYPES:
        log.warning("--prefix-reuse auto: off for model type %s (a cached prefix is shown exact for %s only); every "
                    "sample is computed alone", facts.model_type, ", ".join(PREFIX_EXACT_MODEL_TYPES))
        return {"prefix_reuse": "off"}
    return {"prefix_reuse": "on", "prefix_min_tokens": max(1, cfg.prefix_min_tokens),
            "prefix_cache_tokens": DEFAULT_PREFIX_CACHE_BUDGETS * cfg.token_budget,
            "prefix_forward_tokens": max(1, cfg.prefix_forward_tokens),
            "prefix_stored_tokens": stored_tokens(facts.prefix_stored_budgets, cfg.token_budget),
            "prefix_rows": cfg.prefix_rows}


def _prefixes_said(m: Manifest) -> str:
    return "off" if m.prefix_reuse != "on" else (f"on, spines of >= {m.prefix_min_tokens} tokens, "
                                                  f"{m.forward_tokens} tokens a forward" + (
                                                      f", {m.stored_tokens} tokens stored a batch of trees"
                                                      if m.prefix_stored_tokens else "") + f", rows {m.prefix_rows}")


def resumed_manifest(existing: Manifest | None, planned: Manifest, named_fingerprint: str,
                     recorded_weights: str = "") -> Manifest:
    """``planned`` for a new run; for a run that exists, the same run resumed (ManifestMismatch if it is not).

    ``named_fingerprint``: the dataset's fingerprint as older hsx computed it (its name counted); a run they
    planned resumes with it. ``recorded_weights``: the fingerprint the run's first worker recorded (hsx.life)
    where the manifest had none. A resumed run keeps its creation time and incarnation (a run planned by an
    older hsx keeps none), and records the weights fingerprint if its manifest had none. A model path that
    changes (another folder of the same config and weights) is said in one line."""
    if existing is None:
        return planned
    if existing.dataset_fingerprint == named_fingerprint:  # a run planned when the name counted
        planned = replace(planned, dataset_fingerprint=named_fingerprint)
    if not existing.model_weights and recorded_weights:
        existing = replace(existing, model_weights=recorded_weights)
    check_same_run(existing, planned)
    if not existing.model_weights and planned.model_weights:
        log.warning("run %s was planned by an hsx that did not fingerprint the weights: recording %s's (%s) from "
                    "now on; batches done before were not checked against it", planned.run, planned.model,
                    planned.model_weights)
    if existing.model != planned.model:
        same = ("the same weights fingerprint" if existing.model_weights and planned.model_weights
                else "the weights not compared: one side has no fingerprint")
        log.warning("run %s: its model path changes from %s to %s (same config, %s)", planned.run, existing.model,
                    planned.model, same)
    if _prefixes_said(existing) != _prefixes_said(planned):
        log.warning("run %s keeps shared prefixes %s as planned (this call asked %s): a resumed run is planned as "
                    "it began", planned.run, _prefixes_said(existing), _prefixes_said(planned))
    planned = replace(planned, prefix_reuse=existing.prefix_reuse, prefix_min_tokens=existing.prefix_min_tokens,
                      prefix_cache_tokens=existing.prefix_cache_tokens,
                      prefix_forward_tokens=existing.prefix_forward_tokens,
                      prefix_stored_tokens=existing.prefix_stored_tokens, prefix_rows=existing.prefix_rows)
    return replace(planned, created=existing.created, incarnation=existing.incarnation,
                   model_weights=planned.model_weights or existing.model_weights)
