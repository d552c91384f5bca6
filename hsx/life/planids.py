"""A plan's sample ids, kept in the store rather than Redis.

A newer producer's plan entry in Redis (``BatchSpec.for_plan``) holds the digest of its batch's sample ids, not
the ids (~16 MiB of Redis per million samples with 5-character ids). The ids are in the store twice:

- the batch's inputs object (``<run>/inputs/<shard>/<batch id>.safetensors``), its header's ``sample_ids``: the
  worker reads that object anyway;
- the window's ids object (``<run>/plan/window-<number>.json``: ``{"ids": {batch id: [ids]}}``), written by the
  producer with the window's inputs, before the plan entries: what the producer's resume (the duplicate check)
  and the run's index read, one object a window.

Readers take ids from a spec that holds them (an older plan), else from the store, and check them against the
spec's ``ids_sha256`` (``BatchSpec.ids_match``): a store object never says more than the plan allows.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from hsx.batch import BatchFileError, read_header
from hsx.errors import HsxError
from hsx.life.batchspec import BatchSpec
from hsx.life.windowrecords import window_records
from hsx.store import ObjectNotFound, layout

READ_THREADS = 16   # inputs headers read at once where a window's ids object is missing


class PlanIdsError(HsxError):
    """A batch's sample ids are in neither the plan nor the store (or the store's differ from the plan's)."""


def write_window_ids(store, run: str, number: int, specs: list[BatchSpec]) -> None:
    """Write window ``number``'s ids object (its specs must hold their ids). Same plan, same bytes."""
    ids = {s.batch_id: list(s.sample_ids) for s in specs}
    store.put_bytes(layout.window_ids_key(run, number), json.dumps({"ids": ids}, separators=(",", ":")).encode())


def read_window_ids(store, run: str, number: int) -> dict[str, list[str]]:
    """Window ``number``'s ids object, batch id -> ids; {} if it is missing or not one (then read inputs)."""
    try:
        found = json.loads(store.get_bytes(layout.window_ids_key(run, number)))
    except (ObjectNotFound, ValueError):
        return {}
    ids = found.get("ids") if isinstance(found, dict) else None
    if not isinstance(ids, dict):
        return {}
    return {str(b): v for b, v in ids.items() if isinstance(v, list) and all(isinstance(s, str) for s in v)}


def inputs_ids(store, run: str, spec: BatchSpec) -> list[str]:
    """``spec``'s sample ids: its own, else its inputs object's header's (one range read), checked against the plan."""
    if spec.ids_in_plan:
        return list(spec.sample_ids)
    key = layout.input_key(run, spec.shard, spec.batch_id)
    try:
        header = read_header(lambda start, length: store.get_bytes(key, start, length), key, outputs=False)
    except ObjectNotFound:
        raise PlanIdsError(f"the sample ids of {spec.batch_id} are not in the plan and its inputs object {key} is "
                           "missing from the store; re-run hsx produce to write it again") from None
    except BatchFileError as exc:
        raise PlanIdsError(f"the sample ids of {spec.batch_id}: its inputs object is unreadable ({exc})") from None
    ids = list(header.sample_ids)
    if not spec.ids_match(ids):
        raise PlanIdsError(f"the inputs object {key} holds other sample ids than the plan of {spec.batch_id}")
    return ids


def with_ids(store, run: str, spec: BatchSpec) -> BatchSpec:
    """``spec`` holding its sample ids (read from its inputs object where the plan keeps only their digest)."""
    return spec if spec.ids_in_plan else spec.with_ids(inputs_ids(store, run, spec))


def plan_ids(r, store, run: str, specs: dict[str, BatchSpec]) -> dict[str, list[str]]:
    """Batch id -> sample ids of every spec in ``specs``: the spec's own, else its window's ids object (one read a
    window), else its inputs object's header. PlanIdsError if a batch's ids are nowhere or differ from the plan."""
    out = {bid: list(spec.sample_ids) for bid, spec in specs.items() if spec.ids_in_plan}
    wanted = {spec.index: bid for bid, spec in specs.items() if not spec.ids_in_plan}
    if not wanted:
        return out
    for number, raw in sorted(window_records(r, run).items()):
        try:
            rec = json.loads(raw)
            first, count = int(rec["first_batch"]), int(rec["batches"])
        except (ValueError, KeyError, TypeError):
            continue
        if not any(i in wanted for i in range(first, first + count)):
            continue
        for bid, ids in read_window_ids(store, run, number).items():
            spec = specs.get(bid)
            if spec is not None and bid not in out and spec.ids_match(ids):
                out[bid] = ids
    left = [specs[bid] for bid in wanted.values() if bid not in out]
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for spec, ids in zip(left, pool.map(lambda s: inputs_ids(store, run, s), left), strict=True):
            out[spec.batch_id] = ids
    return out
