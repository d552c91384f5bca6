"""Whether this host can serve a run as its manifest defines it: the checks a GPU worker makes before it loads
the model, in one call.

In order, each failing with one line that says what is wrong and the fix: the run's store answers (an S3 store
within 10 s), the model the manifest names (or ``--model``) is visible here, the store is the run's (its
manifest is there), and the model is the run's: the same config (hash) and, when the run recorded one, the same
weights (fingerprint; a run planned by an older hsx has none to check against). Nothing here needs Redis: the
caller has the manifest already, and Redis' own checks (eviction policy) are the fleet's. The fingerprint is
``hsx.prep``'s, which no wing imports: the caller passes it in.
"""

from __future__ import annotations

from collections.abc import Callable

from hsx.errors import HsxError
from hsx.runspec.manifest import Manifest
from hsx.runspec.targetmodel import config_hash
from hsx.runspec.visibility import check_model_visible, open_run_store
from hsx.store import check_store


class ModelMismatch(HsxError, RuntimeError):
    """The model this host would load is not the run's (another config, another checkpoint)."""


def check_host(manifest: Manifest, model: str, role: str, host: str | None, fingerprint: Callable[[str], str]):
    """The run's store, opened, once this host sees it and ``model`` is the run's model; else StoreUnusable,
    RunNotVisible or ModelMismatch, saying why. ``fingerprint``: the weights' fingerprint of a model
    (``hsx.prep.weights_fingerprint``; "" when this host has no weight files to read). Call it before the
    model is loaded."""
    run = manifest.run
    check_store(manifest.store, role, run=run)
    check_model_visible(model, role, host)
    store = open_run_store(manifest, role, host)  # before the model loads: a wrong mount is seen at once
    if config_hash(model) != manifest.model_config_hash:
        raise ModelMismatch(f"model {model} does not match run {run!r} (config hash differs from the manifest)")
    if manifest.model_weights:  # a run planned by an older hsx has none to check against
        weights = fingerprint(model)
        if weights and weights != manifest.model_weights:
            raise ModelMismatch(f"model {model} is another checkpoint than run {run!r}'s: its weights are "
                                f"{weights}, the run's ({manifest.model}) {manifest.model_weights}")
    return store
