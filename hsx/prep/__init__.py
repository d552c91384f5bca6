"""Token preparation: reading a dataset's rows, rendering and tokenising them, cutting batches.

Never imports run state (`hsx.run`), the batch format (`hsx.batch`) or a store (tests/test_house.py).
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "columns": ["ColumnMapping", "ColumnMappingError", "preset_for"],
    "dataset": ["Row", "RowError", "fingerprints", "iter_rows"],
    "inputs": [
        "SettingsError",
        "check_budget",
        "check_row_settings",
        "resolve_dataset",
        "resolve_model",
        "resolve_store_url",
    ],
    "mixture": {"Mixture": None, "MixtureError": None, "Source": None, "load": "load_mixture",
                "of_datasets": "mixture_of_datasets"},
    "perturn": ["split_turn_id", "turn_id"],
    "planning": ["PlannedBatch", "cut_batches", "padding_fraction"],
    "prefixplan": ["PrefixGroup", "cut_prefix_batches", "find_groups", "find_trees"],
    "report": ["Sample", "TokeniseReport", "Window"],
    "rows": ["RowRejected"],
    "tokenise": ["ChatTokeniser", "parse_template_kwargs"],
    "weights": {"SCHEME": "WEIGHTS_SCHEME", "UnknownScheme": None, "WeightsUnreadable": None, "local_folder": None,
                "fingerprint_cached": None, "scheme_of": None, "weights_fingerprint": None},
    "windows": ["TokeniseSettings", "WindowTokeniser", "default_workers"],
})
