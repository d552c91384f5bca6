"""What a run is: the face of the wing.

Each role's frozen config, what the target makes of a run's settings (``identify``: layers, store dtype; for
`hsx produce` and `hsx inspect`), the run's manifest (built from `hsx produce`'s settings and what it found about
the inputs, validated, compared on resume), what it computes in, the local spool's tiers and files, and whether this
host sees what the manifest names. Everything not named in ``__all__`` is private to the wing.
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "hostcheck": ["ModelMismatch", "check_host", "check_weights"],
    "identity": ["TargetIdentity", "identify"],
    "plan": ["PREFIX_EXACT_MODEL_TYPES", "RunFacts", "plan_manifest", "prefix_settings", "resumed_manifest"],
    "compute": ["ComputeDtypeError", "check_compute_dtype", "check_fp8_accumulation"],
    "config": ["ProduceConfig", "UploadConfig", "WorkerConfig", "with_redis_password"],
    "manifest": [
        "Manifest",
        "ManifestError",
        "ManifestMismatch",
        "RunLimits",
        "check_same_run",
        "new_manifest",
    ],
    "targetmodel": ["ModelNotFound", "config_hash", "load_model_config", "text_config"],
    "spool": {
        "DISK": "DISK_TIER",
        "LEGACY_MEMORY_DIR": None,
        "SpoolTiers": None,
        "Tier": None,
        "auto_memory_budget": None,
        "default_memory_dir": None,
        "is_disk_full": None,
        "remove_empty_folders": "remove_empty_spool_folders",
        "MEMORY": "MEMORY_TIER",
        "adopt_legacy": "adopt_legacy_spool",
        "complete_files": "spool_files",
        "temp_files": "spool_temp_files",
        "temp_tag": "spool_temp_tag",
        "usage": "spool_usage",
    },
    "visibility": ["RunNotVisible", "check_model_visible", "open_run_store"],
})
