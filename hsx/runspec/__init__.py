"""What a run is: the face of the wing.

Each role's frozen config, what the target makes of a run's settings (``identify``: layers, store dtype; for
`hsx produce` and `hsx inspect`), the run's manifest (built from `hsx produce`'s settings and what it found about
the inputs, validated, compared on resume), what it computes in, the local spool's tiers and files, and whether this
host sees what the manifest names. Everything not named in ``__all__`` is private to the wing.
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.face import face
from hsx.runspec.compute import ComputeDtypeError, check_compute_dtype, check_fp8_accumulation
from hsx.runspec.config import ProduceConfig, UploadConfig, WorkerConfig, with_redis_password
from hsx.runspec.hostcheck import ModelMismatch, check_host, check_weights
from hsx.runspec.manifest import Manifest, ManifestError, ManifestMismatch, RunLimits, check_same_run, new_manifest
from hsx.runspec.spool import (
    DISK_TIER,
    LEGACY_MEMORY_DIR,
    MEMORY_TIER,
    SpoolTiers,
    Tier,
    adopt_legacy_spool,
    auto_memory_budget,
    default_memory_dir,
    is_disk_full,
    remove_empty_spool_folders,
    spool_files,
    spool_temp_files,
    spool_temp_tag,
    spool_usage,
)
from hsx.runspec.targetmodel import ModelNotFound, config_hash, load_model_config, text_config
from hsx.runspec.visibility import RunNotVisible, check_model_visible, open_run_store

if TYPE_CHECKING:  # these modules import torch: loaded on first use (hsx/face.py)
    from hsx.runspec.identity import TargetIdentity, identify
    from hsx.runspec.plan import PREFIX_EXACT_MODEL_TYPES, RunFacts, plan_manifest, prefix_settings, resumed_manifest, stored_tokens

__getattr__, __dir__, __all__ = face(__name__, __file__)
