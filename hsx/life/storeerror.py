"""The error of a lossy store dtype (FP8), measured on a sample of each run's batches.

The GPU worker compares, for every ``ERROR_SAMPLE_EVERY``-th batch it runs (and its
first), the dequantised FP8 values with the bf16 values they came from, per
layer: relative L2 (||deq - x|| / ||x|| over the batch) and the mean over
tokens of the cosine similarity. Each sample goes to Redis (``store_error``);
the run-level record, written beside the manifest as
``<run>/store_error.json`` when the run completes, holds per layer the
token-weighted mean and the worst batch of both figures.
"""

from __future__ import annotations

import json

from hsx.life.keys import RunKeys
from hsx.redisconn import text
from hsx.runspec import Manifest
from hsx.store import layout

ERROR_SAMPLE_EVERY = 16   # batches a worker runs between two measured ones


def record_store_error(r, run: str, bid: str, manifest: Manifest, error, tokens: int, pipe=None) -> None:
    """``error``: [2, n] (rel_l2, cosine) per stored layer, a tensor or nested list."""
    rows = error.tolist() if hasattr(error, "tolist") else error
    layers = manifest.stored_layer_names
    entry = {"layer_ids": layers[:len(rows[0])], "rel_l2": rows[0], "cosine": rows[1], "tokens": int(tokens)}
    (pipe or r).hset(RunKeys(run).store_error, bid, json.dumps(entry))


def _problem(sample) -> str | None:
    if not isinstance(sample, dict) or not isinstance(sample.get("tokens"), int):
        return "not a JSON object with integer 'tokens'"
    n = len(sample.get("layer_ids") or [])
    for field in ("rel_l2", "cosine"):
        numbers = sample.get(field)
        if not isinstance(numbers, list) or len(numbers) != n or n == 0 \
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
            return f"{field!r} is not one number a layer"
    return None


def store_error_summary(r, run: str, malformed: list[str] | None = None) -> dict | None:
    """The run-level record (None when nothing was measured: a lossless store dtype). A sample that is not
    what ``record_store_error`` writes is skipped and named in ``malformed`` (when given)."""
    key = RunKeys(run).store_error
    samples = {}
    for bid, raw in r.hscan_iter(key, count=1000):
        try:
            sample = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            sample = None
        wrong = _problem(sample)
        if wrong is None and samples and len(sample["rel_l2"]) != len(next(iter(samples.values()))["rel_l2"]):
            wrong = "another number of layers than the other samples"
        if wrong:
            if malformed is not None:
                malformed.append(f"{key} {text(bid)}: {wrong}")
            continue
        samples[text(bid)] = sample
    if not samples:
        return None
    first = next(iter(samples.values()))
    n = len(first["rel_l2"])
    tokens = sum(s["tokens"] for s in samples.values()) or 1
    out = {"store_dtype_error": "FP8 e4m3 (per-token per-layer scale) against the bf16 values, per layer",
           "layer_ids": first["layer_ids"], "batches_measured": len(samples), "tokens_measured": tokens,
           "rel_l2_mean": [sum(s["rel_l2"][i] * s["tokens"] for s in samples.values()) / tokens for i in range(n)],
           "rel_l2_max": [max(s["rel_l2"][i] for s in samples.values()) for i in range(n)],
           "cosine_mean": [sum(s["cosine"][i] * s["tokens"] for s in samples.values()) / tokens for i in range(n)],
           "cosine_min": [min(s["cosine"][i] for s in samples.values()) for i in range(n)]}
    return out


def write_record(r, store, run: str) -> dict | None:
    """Write ``<run>/store_error.json`` into the store (idempotent); the record, or None if nothing was measured."""
    record = store_error_summary(r, run)
    if record is not None:
        store.put_bytes(layout.store_error_key(run), json.dumps(record, indent=1).encode())
    return record
