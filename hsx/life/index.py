"""The run index: sample id -> (object key, row in batch, object size + SHA-256), written once the run is complete.

A repair (``ledger.unmark_done``) clears the written-marker, so the index is written again with the new
object's digest when the run is complete again.
"""

from __future__ import annotations

import json

from hsx.life import computeerror, ledger, planids, storeerror
from hsx.life.keys import RunKeys
from hsx.store import layout


def build_index_lines(specs: dict[str, ledger.BatchSpec], run: str, infos: dict[str, dict] | None = None) -> bytes:
    """One JSON line a sample: id, key, batch_id, row, and the object's ``size`` and ``sha256`` from the
    ledger (what the reader checks a whole object against; absent where ``infos`` lacks the batch)."""
    infos = infos or {}
    lines = []
    for bid in sorted(specs):
        spec = specs[bid]
        key = layout.batch_key(run, spec.shard, bid)
        info = infos.get(bid) or {}
        digest = {"size": info["size"], "sha256": info["sha256"]} if "sha256" in info else {}
        for row, sample_id in enumerate(spec.sample_ids):
            lines.append(json.dumps({"id": sample_id, "key": key, "batch_id": bid, "row": row, **digest},
                                    separators=(",", ":")))
    return ("\n".join(lines) + "\n").encode()


def write_index_if_complete(r, store, run: str) -> bool:
    """Write ``<run>/index.jsonl`` when every planned batch is done. Idempotent; True if the run is complete."""
    keys = RunKeys(run)
    total, planning = (int(x) if x is not None else None for x in r.hmget(keys.totals, "batches", "planning"))
    if planning or total is None or ledger.done_count(r, run) != total:   # planning: the producer has windows to go
        return False
    if r.get(keys.index_written):
        return True
    storeerror.write_record(r, store, run)
    computeerror.write_record(r, store, run)
    specs = ledger.all_specs(r, run)
    ids = planids.plan_ids(r, store, run, specs)   # a newer plan keeps them in the store
    specs = {bid: spec.with_ids(ids[bid]) for bid, spec in specs.items()}
    info = store.put_bytes(layout.index_key(run), build_index_lines(specs, run, ledger.done_info(r, run)))
    r.set(keys.index_written, info.key)
    return True
