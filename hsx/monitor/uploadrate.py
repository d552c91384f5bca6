"""How fast a host's uploaders finish a run's uploads: what the dashboard's host rows show beside the spool.

Counted from the host's minute counts (``rate_minutes``' ``up:<host>:<minute>:b|t|B``, written with each batch its
uploaders record done: O(minutes)); for a run an older hsx recorded, from the host's ``uploaded`` record
(``Run.uploaded_since``: the batches its uploaders recorded done in the last hour; rq keeps no finished job,
hsx/life/queues.py's ``RESULT_TTL`` is 0), the plan's tokens a batch and the ledger's size a batch.
"""

from __future__ import annotations

import redis

from hsx import life
from hsx.monitor.minutes import window_counts
from hsx.monitor.planstate import plan_tokens


def host_upload_rate(r: redis.Redis, run: str, host: str, tokens_of: dict[str, int] | None, now: float,
                     window: float) -> dict:
    """Uploads of ``run`` finished by ``host``'s uploaders in the last ``window`` s (the run's rate span):
    ``{upload_batches_per_s, upload_tokens_per_s, upload_bytes_per_s}``; ``tokens_of``: batch id -> tokens, where
    the caller holds the plan (else an older run's uploaded batches' plan entries are read)."""
    key = life.RunKeys(run).rate_minutes
    if r.hexists(key, f"up:{host}:since"):   # this hsx's run: minute counts (an older one: its uploaded record)
        batches, tokens, nbytes = window_counts(r, key, f"up:{host}", "btB", now, window)
        return {"upload_batches_per_s": batches / window, "upload_tokens_per_s": tokens / window,
                "upload_bytes_per_s": nbytes / window}
    ledger = life.Run(r, run)
    bids = set(ledger.uploaded_since(host, now - window))
    if tokens_of is None:
        tokens_of = plan_tokens(r, run, sorted(bids), [])
    nbytes = sum(info["size"] for info in ledger.done_records(sorted(bids)).values() if info)
    return {"upload_batches_per_s": len(bids) / window,
            "upload_tokens_per_s": sum(tokens_of.get(b, 0) for b in bids) / window,
            "upload_bytes_per_s": nbytes / window}
