"""Token preparation: reading a dataset's rows, rendering and tokenising them, cutting batches.

Imports no other wing: not a run's spec or life (`hsx.runspec`, `hsx.life`), the batch format (`hsx.batch`) or a
store (tests/test_house.py).
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from hsx.face import face
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
from hsx.prep.mixture import Mixture, MixtureError, Source, load_mixture, mixture_of_datasets
from hsx.prep.perturn import split_turn_id, turn_id
from hsx.prep.planning import PlannedBatch, cut_batches, padding_fraction
from hsx.prep.prefixplan import MAX_HELD, PrefixGroup, cut_prefix_batches, find_groups, find_trees, merged_forwards
from hsx.prep.rejected import RowRejected
from hsx.prep.report import Sample, TokeniseReport, Window
from hsx.prep.tokenise import ChatTokeniser, parse_template_kwargs
from hsx.prep.weights import (
    WEIGHTS_SCHEME,
    UnknownScheme,
    WeightsUnreadable,
    fingerprint_cached,
    local_folder,
    scheme_of,
    weights_fingerprint,
)
from hsx.prep.windows import TokeniseSettings, WindowTokeniser, default_workers

__getattr__, __dir__, __all__ = face(__name__, __file__)
