"""What the target model makes of a run's settings: one identity, for `hsx produce` and `hsx inspect` alike.

``identify`` checks the compute settings, reads the model's config and tokenizer, resolves ``--layers``
against its decoder and chooses the run's store dtype (``--store-dtype``, else ``--dtype``): the one place a
run's store dtype is chosen. It refuses a token budget whose pinned buffers no GPU worker could hold. The
producer adds the fingerprints of the dataset and the weights (``TargetIdentity.facts``) and plans the
manifest from them (hsx/runspec/plan.py); `hsx inspect` estimates the plan from the same identity.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from hsx.batch import check_store_dtype, hidden_bytes_per_token
from hsx.defaults import (
    AUTO_PREFIX_STORED_BUDGETS,
    DEFAULT_PINNED_BUFFERS,
    DEFAULT_PREFIX_STORED_BUDGETS,
    MAX_PINNED_BYTES,
    MAX_TOKEN_BUDGET,
)
from hsx.errors import ConfigError
from hsx.layers import resolve_layers
from hsx.runspec.compute import check_compute_dtype, check_fp8_accumulation
from hsx.runspec.plan import RunFacts
from hsx.runspec.targetmodel import config_hash, load_model_config, text_config


@dataclass(frozen=True)
class TargetIdentity:
    text_cfg: object                # the decoder's part of the model's config (text_config)
    tokenizer: object               # the model's tokenizer (transformers)
    model_config_hash: str          # config_hash() of the model
    layer_ids: tuple[int, ...]      # resolved from --layers, low to high
    store_final: bool               # --layers asked for the final (normed) state
    store_dtype: str                # checked: what batch files hold
    stored_budgets: int = 1         # token budgets a batch of trees stores (--prefix-stored-budgets resolved)

    def facts(self, dataset_fingerprint: str, model_weights: str, mixture: tuple = ()) -> RunFacts:
        """The facts the manifest records, with the producer's fingerprints of the dataset and the weights."""
        pad = self.tokenizer.pad_token_id
        return RunFacts(
            model_config_hash=self.model_config_hash, model_type=self.text_cfg.model_type,
            num_layers=self.text_cfg.num_hidden_layers, hidden_size=self.text_cfg.hidden_size,
            layer_ids=self.layer_ids, store_final=self.store_final, store_dtype=self.store_dtype,
            dataset_fingerprint=dataset_fingerprint,
            chat_template_hash=hashlib.sha256(str(self.tokenizer.chat_template or "").encode()).hexdigest(),
            pad_token_id=pad if pad is not None else 0, model_weights=model_weights, mixture=tuple(mixture),
            prefix_stored_budgets=self.stored_budgets)


def identify(cfg) -> TargetIdentity:
    """The target's identity for settings ``cfg`` (``ProduceConfig``, or hsx inspect's config: ``model`` resolved,
    ``layers``, ``dtype``, ``store_dtype``, ``token_budget``, ``compute_dtype``, ``fp8_accumulation``)."""
    from transformers import AutoTokenizer

    check_fp8_accumulation(cfg.fp8_accumulation, check_compute_dtype(cfg.compute_dtype))
    config = load_model_config(cfg.model)
    text_cfg = text_config(config)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    layer_ids, store_final = resolve_layers(cfg.layers, text_cfg.num_hidden_layers)
    store_dtype = check_store_dtype(cfg.store_dtype or cfg.dtype)
    per_token = hidden_bytes_per_token(text_cfg.hidden_size, len(layer_ids) + store_final, store_dtype)
    stored_budgets = fit_stored_budgets(cfg.prefix_stored_budgets, cfg.token_budget, per_token) \
        if cfg.prefix_reuse != "off" else 1
    check_pinned_memory(cfg.token_budget, per_token, store_dtype, stored_budgets)
    return TargetIdentity(text_cfg, tokenizer, config_hash(config), tuple(layer_ids), store_final, store_dtype,
                          stored_budgets)


def pinned_bytes(token_budget: int, per_token: int, stored_budgets: int = 1) -> int:
    """Pinned host memory a GPU worker may hold: DEFAULT_PINNED_BUFFERS buffers of a batch's stored tokens."""
    return DEFAULT_PINNED_BUFFERS * token_budget * per_token * stored_budgets


def fit_stored_budgets(budgets: int, token_budget: int, per_token: int) -> int:
    """``--prefix-stored-budgets`` resolved: as given (check_pinned_memory and the manifest's bounds judge it), or
    for AUTO_PREFIX_STORED_BUDGETS (the default) the most, up to DEFAULT_PREFIX_STORED_BUDGETS, that keep a batch
    within MAX_TOKEN_BUDGET and the pinned buffers within MAX_PINNED_BYTES; at least 1."""
    if budgets != AUTO_PREFIX_STORED_BUDGETS:
        return budgets
    return max(n for n in range(1, DEFAULT_PREFIX_STORED_BUDGETS + 1) if n == 1 or (
        n * token_budget <= MAX_TOKEN_BUDGET and pinned_bytes(token_budget, per_token, n) <= MAX_PINNED_BYTES))


def check_pinned_memory(token_budget: int, per_token: int, store_dtype: str, stored_budgets: int = 1) -> None:
    """A GPU worker pins DEFAULT_PINNED_BUFFERS x token_budget x the bytes a token stores (Manifest.host_bytes_per_token),
    and up to as many buffers of ``stored_budgets`` budgets where batches of trees store more
    (--prefix-stored-budgets); refuse absurd budgets."""
    need = pinned_bytes(token_budget, per_token, stored_budgets)
    if need > MAX_PINNED_BYTES:
        stored = f" x --prefix-stored-budgets {stored_budgets}" if stored_budgets > 1 else ""
        raise ConfigError(f"--token-budget {token_budget}{stored} needs {need / 2**30:.0f} GiB of pinned host memory "
                          f"per GPU worker ({DEFAULT_PINNED_BUFFERS} x budget{stored} x {per_token} bytes a token of "
                          f"{store_dtype}); at most {MAX_PINNED_BYTES // 2**30} GiB: lower "
                          + ("--prefix-stored-budgets or --token-budget" if stored else "--token-budget"))
