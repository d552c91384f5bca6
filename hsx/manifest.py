"""The run manifest: what a run is, so that a resume against something else is refused."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from hsx import __version__
from hsx import defaults as D
from hsx.errors import HsxError

# Fields that define the run's output; a resume must agree on every one.
IDENTITY_FIELDS = ("model_config_hash", "layer_ids", "store_final", "dtype", "store_dtype", "codec", "hidden_size", "num_layers",
                   "max_length", "overlong", "token_budget", "pad_multiple", "max_batch_rows", "batches_per_shard",
                   "dataset_fingerprint", "chat_template_hash", "store_url", "template_kwargs", "columns",
                   "window_rows", "compute_dtype")


@dataclass(frozen=True)
class RunLimits:
    """Limits every role of a run must agree on, set by `hsx produce` and kept in the manifest.

    ``max_attempts``: failures of a batch, whoever saw them (an extract job that raised, a worker
    lost with its lease, a spool file lost before upload: each costs one extraction), before the
    batch goes to dead letters. ``lease_seconds``: how long a lease lives without a refresh.
    """

    max_attempts: int = D.DEFAULT_MAX_ATTEMPTS
    lease_seconds: int = D.DEFAULT_LEASE_SECONDS

    @classmethod
    def of(cls, manifest: dict) -> RunLimits:
        """From a manifest (one written before limits were recorded gets the defaults)."""
        limits = manifest.get("limits") or {}
        return cls(int(limits.get("max_attempts", D.DEFAULT_MAX_ATTEMPTS)),
                   int(limits.get("lease_seconds", D.DEFAULT_LEASE_SECONDS)))

    def to_dict(self) -> dict:
        return {"max_attempts": self.max_attempts, "lease_seconds": self.lease_seconds}


class ManifestMismatch(HsxError, RuntimeError):
    """A run exists with a different manifest."""


def build_manifest(**fields) -> dict:
    manifest = dict(fields)
    manifest.setdefault("hsx_version", __version__)
    manifest.setdefault("created", dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    manifest["format"] = "hsx-run/1"
    return manifest


def _identity(manifest: dict, key: str):
    """A field as it defines the run (runs planned before store_dtype/codec/compute_dtype existed had their defaults)."""
    defaults = {"store_dtype": manifest.get("dtype"), "codec": "none", "compute_dtype": "bfloat16"}
    value = manifest.get(key)
    if key == "store_url" and value:  # manifests before issue 20 may hold a relative local store: as seen from here
        from hsx.prep.inputs import resolve_store_url

        return resolve_store_url(value)
    return defaults.get(key) if value is None else value


def check_same_run(existing: dict, wanted: dict, run: str) -> None:
    diffs = [f"{k}: run has {_identity(existing, k)!r}, this call has {_identity(wanted, k)!r}"
             for k in IDENTITY_FIELDS if _identity(existing, k) != _identity(wanted, k)]
    if diffs:
        raise ManifestMismatch(f"run {run!r} already exists with a different manifest; refusing to mix outputs. "
                               "Use a new --run name, the original settings, or start it over with `hsx reset --run "
                               f"{run} --store STORE`. Differences:\n  " + "\n  ".join(diffs))


class ModelNotFound(HsxError):
    """The model is neither a local folder with a config.json nor a hub id this machine can fetch."""


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or "\\" in model


def load_model_config(model: str):
    """The model's transformers config, from a local folder or the hub; ModelNotFound says which and why."""
    from transformers import AutoConfig

    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"model {model}: the folder has no config.json (is it a Hugging Face model folder?)")
        return AutoConfig.from_pretrained(str(path))
    if _looks_like_path(model):
        raise ModelNotFound(f"model path {model} does not exist: give a local model folder (with config.json) "
                            "or a hub id such as Qwen/Qwen3-8B")
    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:  # transformers reports a missing repo / no network as OSError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ModelNotFound(f"model {model!r} is not a local folder and the hub did not give it ({reason}); check "
                            "the id, HF_TOKEN for a gated model, the network or HF_HUB_OFFLINE") from None


def config_hash(model) -> str:
    """SHA-256 of the model's config (canonical JSON, volatile fields dropped); a path/id or a loaded config."""
    import hashlib
    import json

    cfg = (load_model_config(model) if isinstance(model, str) else model).to_dict()
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(volatile, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
