"""The error of FP8 compute (``--compute-dtype float8``), measured once per run on the run's own data.

A GPU worker of a float8 run that finds no record, and wins the claim (``SET NX`` with the run's lease as
TTL, so two workers starting together do not both measure), runs its first batch twice: once with the
decoder's linears as they were before FP8 (the reference: bf16 on a GPU, the checkpoint's own weights) and
once as FP8 GEMMs, the batch it stores. Per stored layer (and the final state, if stored) it compares the
two: relative L2 ``||x - ref|| / ||ref||`` over the batch's tokens and the mean over tokens of
``cosine(x, ref)``. One extra forward on the GPU thread, once per run; the conversion of the linears to FP8
that load did before is moved to that first batch (no extra cost).

The record goes to Redis (``compute_error``, ``SET NX``: the first writer wins, every later one is
dropped), and beside the manifest as ``<run>/compute_error.json`` when the run completes. An FP8
checkpoint has no bf16 weights: its reference is bf16 linears of the checkpoint's e4m3 weights dequantised
(the checkpoint's own quantisation is not in that figure; ``reference`` says which).

Record (JSON): ``{"compute_dtype_error", "reference", "accumulation", "layer_ids", "rel_l2", "cosine",
"batch_id", "tokens", "worker", "ts"}`` (``accumulation``: the run's --fp8-accumulation, fp32 or fast),
``rel_l2``/``cosine`` one float a stored layer, in ``layer_ids`` order.
"""

from __future__ import annotations

import json
import time

from hsx.life.keys import RunKeys
from hsx.runspec import Manifest
from hsx.store import layout

WHAT = "FP8 e4m3 GEMMs (weights per output row, activations per token) against the reference, per stored layer"
BF16_REFERENCE = "the checkpoint's {dtype} weights in {dtype} linears (what --compute-dtype bfloat16 computes)"
DEQUANTISED_REFERENCE = ("{dtype} linears of the e4m3 weights dequantised (an FP8 checkpoint has no other weights): "
                         "the weights' own quantisation is not in this figure")


def claim_compute_error(r, run: str, worker: str, ttl_seconds: int) -> bool:
    """True when this worker measures: no record yet and the claim is its own (it expires after
    ``ttl_seconds``, so a worker that died measuring leaves the measurement to one that starts later)."""
    keys = RunKeys(run)
    if r.exists(keys.compute_error):
        return False
    return bool(r.set(keys.compute_error_claim, worker, nx=True, ex=max(1, int(ttl_seconds))))


def compute_error_recorded(r, run: str) -> bool:
    return bool(r.exists(RunKeys(run).compute_error))


def record_compute_error(r, run: str, bid: str, manifest: Manifest, error, tokens: int, reference: str, worker: str,
           pipe=None) -> dict:
    """Write the run's record unless one exists (first writer wins); the entry this writer offered."""
    rows = error.tolist() if hasattr(error, "tolist") else error
    entry = {"compute_dtype_error": WHAT, "reference": reference, "accumulation": manifest.fp8_accumulation,
             "layer_ids": manifest.stored_layer_names[:len(rows[0])],
             "rel_l2": rows[0], "cosine": rows[1], "batch_id": bid, "tokens": int(tokens), "worker": worker,
             "ts": time.time()}
    (pipe or r).set(RunKeys(run).compute_error, json.dumps(entry), nx=True)
    return entry


def problem(value) -> str | None:
    """What is wrong with a decoded record, or None."""
    if not isinstance(value, dict):
        return f"not a JSON object ({type(value).__name__})"
    columns = value.get("layer_ids")
    if not isinstance(columns, list):
        return "no 'layer_ids' list"
    for field in ("rel_l2", "cosine"):
        numbers = value.get(field)
        if not isinstance(numbers, list) or len(numbers) != len(columns) \
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
            return f"{field!r} is not {len(columns)} numbers"
    return None


def compute_error(r, run: str, malformed: list[str] | None = None) -> dict | None:
    """The run's record, or None (not measured, or a record hsx did not write: named in ``malformed``)."""
    return read_layer_record(r, RunKeys(run).compute_error, malformed)


def read_layer_record(r, key: str, malformed: list[str] | None = None) -> dict | None:
    """A JSON record of per-layer ``rel_l2`` / ``cosine`` at ``key`` (this one, hsx/life/prefixerror.py's), or None:
    absent, or not what hsx writes (named in ``malformed``)."""
    raw = r.get(key)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        value, wrong = None, "not JSON"
    else:
        wrong = problem(value)
    if wrong:
        if malformed is not None:
            malformed.append(f"{key}: {wrong}")
        return None
    return value


def write_record(r, store, run: str) -> dict | None:
    """Write ``<run>/compute_error.json`` into the store (the Redis record's bytes: idempotent); the record,
    or None if nothing was measured (a bfloat16 run)."""
    measured = compute_error(r, run)
    if measured is not None:
        store.put_bytes(layout.compute_error_key(run), json.dumps(measured, indent=1).encode())
    return measured
