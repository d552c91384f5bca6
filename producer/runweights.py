"""The run's weights fingerprint as `hsx produce` plans or resumes it.

- The producer fingerprints the model's weight files when this host has them (hsx/prep/weights.py); where it
  has none (a hub id not downloaded here), it says so in one line: the first worker that loads the weights
  records their fingerprint, and every later worker must match it.
- On resume, the fingerprint is computed in the scheme of the run's manifest (a run an older hsx planned holds
  ``sampled-v1``), and this call's full fingerprint is compared with the one the run's first worker recorded.
- A manifest without a fingerprint takes the recorded one (in Redis and the store's manifest.json).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from hsx import life
from hsx.prep import weights_fingerprint
from hsx.runspec import Manifest, ManifestMismatch

log = logging.getLogger(__name__)


def comparable(planned: Manifest, existing: Manifest | None, recorded: dict | None) -> Manifest:
    """``planned`` with its weights fingerprint in the scheme of ``existing``'s; ManifestMismatch, naming both,
    if this call's weights are not those the run's first worker ``recorded``."""
    ours = planned.model_weights
    if recorded and ours and _scheme(recorded["fingerprint"]) == _scheme(ours) and recorded["fingerprint"] != ours:
        raise ManifestMismatch(
            f"run {planned.run!r} already exists with other weights: its first worker recorded "
            f"{recorded['fingerprint']} (loaded from {recorded['model']}), this call has {ours} (model "
            f"{planned.model}): another checkpoint. Use a new --run name or the run's model")
    if existing is not None and existing.model_weights and ours and _scheme(existing.model_weights) != _scheme(ours):
        planned = replace(planned, model_weights=weights_fingerprint(planned.model, _scheme(existing.model_weights)))
    return planned


def say_unfingerprinted(planned: Manifest, recorded: dict | None) -> None:
    """The one line a producer that cannot fingerprint the weights says at plan time."""
    if planned.model_weights:
        return
    follows = (f"workers are checked against the fingerprint its first worker recorded ({recorded['fingerprint']}, "
               f"from {recorded['model']})" if recorded else
               "the first worker that loads the weights records their fingerprint, and every later worker must "
               "match it")
    log.warning("run %s: this host has no weight files of model %s to fingerprint, so it is planned without the "
                "weights' fingerprint: %s", planned.run, planned.model, follows)


def with_recorded(run: life.Run, manifest: Manifest) -> Manifest:
    """``manifest`` with the fingerprint the run's first worker recorded, where it holds none."""
    if manifest.model_weights:
        return manifest
    recorded = run.recorded_weights()
    return replace(manifest, model_weights=recorded["fingerprint"]) if recorded else manifest


def _scheme(fingerprint: str) -> str:
    return fingerprint.partition(":")[0]
