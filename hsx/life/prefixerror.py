"""How far samples continued from a shared prefix's cached states are from the same samples computed alone.

Shared prefixes are computed once where a plan says so (hsx/prep/prefixplan.py, gpu_worker/prefixrun.py); on the
CPU every stored sample equals a lone forward within the reference tolerance (tests/test_prefix_reuse.py), but on
a GPU the fused kernels continue a cache in kernels no test here runs. So the first batch with prefix groups a
worker process runs is computed twice, the second time with every sample alone (one extra forward, once a
process), and per stored layer the relative L2 ``||shared - lone|| / ||lone||`` over the batch's tokens and the
mean cosine are kept here: ``hsx status`` shows it, and a worker warns past WARN_REL_L2.

Record (JSON, ``SET NX``: the first writer wins): ``{"layer_ids", "rel_l2", "cosine", "batch_id", "groups",
"tokens", "worker", "ts"}``.
"""

from __future__ import annotations

import json
import time

from hsx.life.computeerror import read_layer_record
from hsx.life.keys import RunKeys

# Past this relative L2 on any stored layer a worker warns: numerics of a continued kernel against a lone one
# stay near bf16's rounding (trained weights); a state continued from the wrong row is tens of per cent.
PREFIX_WARN_REL_L2 = 0.02


def prefix_error_recorded(r, run: str) -> bool:
    return bool(r.exists(RunKeys(run).prefix_error))


def record_prefix_error(r, run: str, bid: str, layer_ids, error, groups: int, tokens: int, worker: str) -> dict:
    """Write the run's record unless one exists; the entry this writer offered."""
    rows = error.tolist() if hasattr(error, "tolist") else error
    entry = {"layer_ids": list(layer_ids)[:len(rows[0])], "rel_l2": rows[0], "cosine": rows[1], "batch_id": bid,
             "groups": int(groups), "tokens": int(tokens), "worker": worker, "ts": time.time()}
    r.set(RunKeys(run).prefix_error, json.dumps(entry), nx=True)
    return entry


def prefix_error(r, run: str, malformed: list[str] | None = None) -> dict | None:
    """The run's record, or None (not measured, or a record hsx did not write: named in ``malformed``)."""
    return read_layer_record(r, RunKeys(run).prefix_error, malformed)


def prefix_error_line(entry: dict) -> str:
    """`hsx status`'s line for the record."""
    worst = max(entry["rel_l2"]) if entry["rel_l2"] else 0.0
    return (f"  prefixes shared vs lone: rel L2 <= {worst:.2e}, cosine >= {min(entry['cosine'] or [1.0]):.6f} "
            f"over {len(entry['rel_l2'])} stored layers (batch {entry['batch_id']}, {entry['groups']} prefix "
            f"groups, {entry['tokens']:,} tokens)" + (" ABOVE 2 %: see the worker's log" if worst > PREFIX_WARN_REL_L2 else ""))
