"""Token preparation: reading a dataset's rows, rendering and tokenising them, cutting batches.

Never imports run state (`hsx.run`), the batch format (`hsx.batch`) or a store (tests/test_house.py).
"""

from __future__ import annotations

from hsx.prep.columns import ColumnMapping, ColumnMappingError, preset_for
from hsx.prep.dataset import Row, RowError, fingerprints, iter_rows
from hsx.prep.inputs import (
    SettingsError,
    check_budget,
    check_row_settings,
    resolve_dataset,
    resolve_model,
    resolve_store_url,
)
from hsx.prep.planning import PlannedBatch, cut_batches, padding_fraction
from hsx.prep.report import Sample, TokeniseReport, Window
from hsx.prep.rows import RowRejected
from hsx.prep.tokenise import ChatTokeniser, parse_template_kwargs
from hsx.prep.weights import weights_fingerprint
from hsx.prep.windows import TokeniseSettings, WindowTokeniser, default_workers

__all__ = [
    "Row",
    "RowError",
    "fingerprints",
    "iter_rows",
    "ColumnMapping",
    "ColumnMappingError",
    "preset_for",
    "RowRejected",
    "ChatTokeniser",
    "parse_template_kwargs",
    "TokeniseSettings",
    "WindowTokeniser",
    "default_workers",
    "Sample",
    "TokeniseReport",
    "Window",
    "PlannedBatch",
    "cut_batches",
    "padding_fraction",
    "SettingsError",
    "check_budget",
    "check_row_settings",
    "resolve_dataset",
    "resolve_model",
    "resolve_store_url",
    "weights_fingerprint",
]
