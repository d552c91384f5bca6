"""A SpecForge 0.2.0 draft model config that reads an hsx run's layers (``draft_config.json``).

SpecForge generates a draft config from the target when ``model.draft_model_config`` is unset, but the one
it generates does not fit an hsx run: its DFlash draft reads one target layer (``build_target_layer_ids(L,
1)``), so its input projection refuses a run of n layers (a shape mismatch), and it generates none for
DSpark (``requires model.draft_model_config``). ``draft_config`` writes what SpecForge would generate (the
target's sizes, read the way SpecForge reads them, and its per-algorithm defaults: one draft layer; DFlash
and DSpark blocks of 16, EAGLE-3 a 32000-token draft vocabulary) with the run's layer ids in the fields
SpecForge reads them from:

- ``dflash`` / ``dspark``: ``dflash_config.target_layer_ids`` (SpecForge's layer numbering = hsx's); a
  DSpark draft keeps SpecForge's defaults (no Markov head, no confidence head) and its attention mode
  follows the target's heads (``gqa`` when it has fewer KV heads than query heads, else ``mha``: the
  DSpark draft refuses ``gqa`` otherwise);
- ``eagle3``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` (EAGLE-3's draft reads exactly three), and
  ``draft_vocab_size`` at most the target's vocabulary (SpecForge maps a smaller one from the data).

`hsx export --for specforge-*` writes it beside the export and ``python -m hsx_peers.specforge train``
writes it for a run read in place; both print the ``model.draft_model_config`` setting that uses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hsx.errors import ConfigError

FILE = "draft_config.json"
# The target config fields SpecForge 0.2.0 copies into a generated draft config
# (specforge.training.model_loading._TARGET_ARCHITECTURE_FIELDS).
TARGET_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "max_position_embeddings", "rms_norm_eps", "hidden_act", "initializer_range", "attention_bias",
                 "attention_dropout", "head_dim", "rope_theta", "rope_scaling", "bos_token_id", "eos_token_id",
                 "pad_token_id", "sliding_window", "use_sliding_window", "max_window_layers")
ARCHITECTURES = {"eagle3": ("LlamaForCausalLMEagle3", "llama"), "dflash": ("DFlashDraftModel", "qwen3"),
                 "dspark": ("DSparkDraftModel", "qwen3")}
DRAFT_VOCAB = 32000   # SpecForge's EAGLE-3 default
BLOCK_SIZE = 16       # SpecForge's DFlash default
EAGLE3_LAYERS = 3


def _value(value):
    return str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value


def draft_config(model: str, strategy: str, layer_ids: list[int]) -> dict:
    """The draft config for SpecForge ``strategy`` on target ``model`` (a path or hub id) reading ``layer_ids``."""
    if strategy not in ARCHITECTURES:
        raise ConfigError(f"no SpecForge draft config for {strategy!r} (want one of {', '.join(ARCHITECTURES)})")
    if strategy == "eagle3" and len(layer_ids) != EAGLE3_LAYERS:
        raise ConfigError(f"SpecForge's EAGLE-3 draft reads exactly {EAGLE3_LAYERS} layers, the run has "
                          f"{len(layer_ids)} ({layer_ids}); produce with --layers eagle3 or three ids +final")
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(model)
    target = getattr(target, "text_config", target)
    payload = {f: _value(getattr(target, f)) for f in TARGET_FIELDS if getattr(target, f, None) is not None}
    payload["vocab_size"] = int(getattr(target, "padded_vocab_size", None) or target.vocab_size)
    architecture, model_type = ARCHITECTURES[strategy]
    payload.update(architectures=[architecture], model_type=model_type, num_hidden_layers=1,
                   tie_word_embeddings=False, use_cache=True)
    if payload.get("pad_token_id") is None:
        payload["pad_token_id"] = 0
    if strategy == "eagle3":
        payload["draft_vocab_size"] = min(DRAFT_VOCAB, payload["vocab_size"])
        payload["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
        return payload
    payload.update(num_target_layers=int(target.num_hidden_layers), block_size=BLOCK_SIZE,
                   layer_types=["full_attention"], sliding_window=None, use_sliding_window=False)
    payload["dflash_config"] = {"target_layer_ids": list(layer_ids)}
    if strategy == "dspark":
        heads, kv_heads = payload["num_attention_heads"], payload.get("num_key_value_heads", payload["num_attention_heads"])
        payload["dflash_config"]["attention_mode"] = "gqa" if kv_heads < heads else "mha"
    return payload


def write_draft_config(path: Path, model: str, strategy: str, layer_ids: list[int]) -> Path:
    """Write ``draft_config(...)`` to ``path`` (atomically); returns the path."""
    text = json.dumps(draft_config(model, strategy, layer_ids), indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def config_line(path: Path) -> str:
    """The ``specforge train`` override (or run.yaml's ``model.draft_model_config``) that uses ``path``."""
    return f"model.draft_model_config={path.resolve()}"
