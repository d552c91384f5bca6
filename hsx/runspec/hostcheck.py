"""Whether this host can serve a run as its manifest defines it: the checks a GPU worker makes before it loads
the model, in one call (``check_host``), and the one it makes once the weights are loaded (``check_weights``).

In order, each failing with one line that says what is wrong and the fix: the run's store answers (an S3 store
within 10 s), the model the manifest names (or ``--model``) is visible here, the store is the run's (its
manifest is there), and the model is the run's: the same config (hash); after the load, the same weights
(fingerprint: the manifest's, and the first worker's record where the manifest has none in this hsx's scheme).
Nothing here needs Redis: the caller has the manifest already and passes the record's verb in, and Redis' own
checks (eviction policy) are the fleet's. The fingerprint is ``hsx.prep``'s, which no wing imports: the caller
passes it in too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hsx.errors import HsxError
from hsx.runspec.manifest import Manifest
from hsx.runspec.targetmodel import config_hash
from hsx.runspec.visibility import check_model_visible, open_run_store
from hsx.store import check_store

log = logging.getLogger(__name__)


class ModelMismatch(HsxError, RuntimeError):
    """The model this host would load is not the run's (another config, another checkpoint)."""


def check_host(manifest: Manifest, model: str, role: str, host: str | None):
    """The run's store, opened, once this host sees it and ``model`` has the run's config; else StoreUnusable,
    RunNotVisible or ModelMismatch, saying why. Call it before the model is loaded; ``check_weights`` after."""
    run = manifest.run
    check_store(manifest.store, role, run=run)
    check_model_visible(model, role, host)
    store = open_run_store(manifest, role, host)  # before the model loads: a wrong mount is seen at once
    if config_hash(model) != manifest.model_config_hash:
        raise ModelMismatch(f"model {model} does not match run {run!r} (config hash differs from the manifest)")
    return store


def check_weights(manifest: Manifest, loaded: str, fingerprint: Callable[[str, str | None], str],
                  record: Callable[[str], dict]) -> str:
    """The fingerprint of the weights loaded from ``loaded`` (a folder), once they are the run's; else
    ModelMismatch naming both fingerprints and both models. Call it after the weights loaded (their files are
    in the page cache then).

    ``fingerprint(model, scheme)``: hsx.prep.weights_fingerprint, in this hsx's scheme for None ("" when this
    host has no weight files; an HsxError for a scheme it cannot compute). ``record(fingerprint)``: offers it as
    the run's (hsx.life.Run.record_weights) and returns the record that holds, this one or the first worker's. The
    manifest's fingerprint is compared in its own scheme (the part before ':'); where that is not this hsx's
    (a run planned by an older hsx) or there is none (planned without the weights), the record is compared."""
    run, known = manifest.run, manifest.model_weights
    ours = fingerprint(loaded, None)
    if not ours:
        log.warning("run %s: no weight files of %s on this host to fingerprint: the weights are not checked",
                    run, loaded)
        return ""
    if known:
        mine = _in_scheme_of(known, ours, loaded, fingerprint)
        if mine != known:
            raise ModelMismatch(f"model {loaded} is another checkpoint than run {run!r}'s: its weights are {mine}, "
                                f"the run's ({manifest.model}) {known}")
        if mine == ours:
            return ours
    held = record(ours)
    first = held["fingerprint"]
    mine = _in_scheme_of(first, ours, loaded, fingerprint)
    if mine != first:
        raise ModelMismatch(f"model {loaded} is another checkpoint than run {run!r}'s: its weights are {mine}, the "
                            f"run's as its first worker ({held.get('worker')!s:.80}) loaded them from "
                            f"{held['model']} are {first}")
    return ours


def _in_scheme_of(theirs: str, ours: str, loaded: str, fingerprint: Callable[[str, str | None], str]) -> str:
    """The loaded weights' fingerprint in the scheme of ``theirs`` (``ours`` is in this hsx's)."""
    scheme = theirs.partition(":")[0]
    return ours if scheme == ours.partition(":")[0] else fingerprint(loaded, scheme)
