"""What a run is: the face of the wing.

Each role's frozen config, the run's manifest (built, validated, compared on resume), what it computes in,
the local spool's tiers and files, and whether this host sees what the manifest names. Everything not named in
``__all__`` is private to the wing.
"""

from __future__ import annotations

from hsx.runspec.compute import ComputeDtypeError, check_compute_dtype, check_fp8_accumulation
from hsx.runspec.config import ProduceConfig, UploadConfig, WorkerConfig, with_redis_password
from hsx.runspec.hostcheck import ModelMismatch, check_host
from hsx.runspec.manifest import (
    Manifest,
    ManifestError,
    RunLimits,
    check_same_run,
    config_hash,
    load_model_config,
    new_manifest,
    text_config,
)
from hsx.runspec.spool import (
    DISK as DISK_TIER,
)
from hsx.runspec.spool import (
    LEGACY_MEMORY_DIR,
    SpoolTiers,
    Tier,
    auto_memory_budget,
    default_memory_dir,
    is_disk_full,
)
from hsx.runspec.spool import (
    MEMORY as MEMORY_TIER,
)
from hsx.runspec.spool import (
    adopt_legacy as adopt_legacy_spool,
)
from hsx.runspec.spool import (
    complete_files as spool_files,
)
from hsx.runspec.spool import (
    temp_files as spool_temp_files,
)
from hsx.runspec.spool import (
    usage as spool_usage,
)
from hsx.runspec.visibility import RunNotVisible, check_model_visible, open_run_store

__all__ = [
    "ProduceConfig",
    "UploadConfig",
    "WorkerConfig",
    "with_redis_password",
    "Manifest",
    "ManifestError",
    "RunLimits",
    "check_same_run",
    "config_hash",
    "load_model_config",
    "new_manifest",
    "text_config",
    "ComputeDtypeError",
    "check_compute_dtype",
    "check_fp8_accumulation",
    "DISK_TIER",
    "LEGACY_MEMORY_DIR",
    "MEMORY_TIER",
    "SpoolTiers",
    "Tier",
    "adopt_legacy_spool",
    "auto_memory_budget",
    "default_memory_dir",
    "is_disk_full",
    "spool_files",
    "spool_temp_files",
    "spool_usage",
    "RunNotVisible",
    "check_model_visible",
    "ModelMismatch",
    "check_host",
    "open_run_store",
]
