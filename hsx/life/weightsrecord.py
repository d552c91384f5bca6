"""The run's weights fingerprint as its first worker found it.

A run planned where the producer could not read the weights (a hub id not downloaded on its host) has no
fingerprint in its manifest, and one planned by an older hsx has only the sampled one. The first worker that
loads the weights records the full fingerprint of what it loaded (``SET NX``: the first writer wins, in one Lua
script that also needs the run's manifest, so a reset run gets no record); every later worker compares its own
against it. A manifest with no fingerprint at all takes it in the same script, if it is still the manifest the
worker read (the worker then writes the store's manifest.json); `hsx produce` of the run takes the record into
the manifest too, whatever wrote the manifest in between.

Record (JSON): ``{"fingerprint", "model", "worker", "host", "ts"}`` (``model``: the folder the worker loaded).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from hsx.errors import HsxError
from hsx.life.keys import RunKeys
from hsx.runspec import Manifest

MAX_TEXT = 4096  # characters of a recorded field (as the manifest's)

# KEYS: the record, the manifest. ARGV: the record offered; the manifest read ("": leave it); that manifest with
# the fingerprint. Returns the record that holds, or false (no manifest).
_RECORD = """
if redis.call('EXISTS', KEYS[2]) == 0 then return false end
local won = redis.call('SET', KEYS[1], ARGV[1], 'NX')
if won and ARGV[2] ~= '' and redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('SET', KEYS[2], ARGV[3]) end
return redis.call('GET', KEYS[1])
"""


class WeightsRecordError(HsxError, ValueError):
    """The run's weights record is not one hsx wrote (or the run is gone)."""


def record_weights(r, run: str, fingerprint: str, model: str, worker: str, host: str,
           manifest: Manifest | None = None) -> dict:
    """Offer this worker's fingerprint as the run's; the record that holds (this one, or the first worker's).
    ``manifest``: the run's as this worker read it; one without a fingerprint takes this one if it wins (and
    Redis still holds that manifest)."""
    keys = RunKeys(run)
    offered = json.dumps({"fingerprint": fingerprint, "model": model, "worker": worker, "host": host,
                          "ts": time.time()}, sort_keys=True)
    read, updated = "", ""
    if manifest is not None and not manifest.model_weights:
        read, updated = manifest.to_json(), replace(manifest, model_weights=fingerprint).to_json()
    raw = r.eval(_RECORD, 2, keys.model_weights, keys.manifest, offered, read, updated)
    if raw is None:
        raise WeightsRecordError(f"run {run!r} has no manifest in Redis any more (reset or flushed): no weights "
                                 "fingerprint recorded")
    return _parse(raw, keys.model_weights)


def recorded_weights(r, run: str) -> dict | None:
    """The run's record, None if no worker recorded one; WeightsRecordError if it is not one hsx wrote."""
    key = RunKeys(run).model_weights
    raw = r.get(key)
    return None if raw is None else _parse(raw, key)


def _parse(raw, key: str) -> dict:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        value = None
    if not isinstance(value, dict) or not all(
            isinstance(value.get(f), str) and 0 < len(value[f]) <= MAX_TEXT for f in ("fingerprint", "model")):
        raise WeightsRecordError(f"{key} is not a weights record hsx wrote (want JSON with 'fingerprint' and "
                                 f"'model'): {str(raw)[:80]!r}; delete the key and start a worker to record it again")
    return value
