"""The target model as a run knows it: its transformers config, the decoder's part of it, and its hash.

A model is a local folder with a config.json or a hub id; ``load_model_config`` says which of the two failed
and why (``ModelNotFound``). ``config_hash`` is the manifest's ``model_config_hash``: what a resume, a worker
on another host and a reader compare.
"""

from __future__ import annotations

from pathlib import Path

from hsx.errors import HsxError


class ModelNotFound(HsxError):
    """The model is neither a local folder with a config.json nor a hub id this machine can fetch."""


def looks_like_path(model: str) -> bool:
    """A local path (absolute, relative or with more than one slash), not a hub id such as Qwen/Qwen3-8B."""
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or "\\" in model


def load_model_config(model: str):
    """The model's transformers config, from a local folder or the hub; ModelNotFound says which and why."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model {model}: the folder has no config.json (is it a Hugging Face model folder?)")
        return AutoConfig.from_pretrained(str(path))
    if looks_like_path(model):
        raise ModelNotFound(f"model path {model} does not exist: give a local model folder (with config.json) "
                            "or a hub id such as Qwen/Qwen3-8B")
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:  # transformers reports a missing repo / no network as OSError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ModelNotFound(f"model {model!r} is not a local folder and the hub did not give it ({reason}); check "
                            "the id, HF_TOKEN for a gated model, the network or HF_HUB_OFFLINE") from None


def text_config(config):
    """The decoder's part of a model config: a multimodal model's ``text_config``, else the config itself."""
    return getattr(config, "text_config", None) or config


def config_hash(model) -> str:
    """SHA-256 of the model's config (canonical JSON, volatile fields dropped); a path/id or a loaded config."""
    import hashlib
    import json

    cfg = (load_model_config(model) if isinstance(model, str) else model).to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(volatile, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
