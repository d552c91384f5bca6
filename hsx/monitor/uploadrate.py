"""How fast a host's uploaders finish a run's uploads: what the dashboard's host rows show beside the spool.

Counted from the host's ``uploaded`` record (``life.uploaded_since``: the batches its uploaders recorded done in
the last hour; rq keeps no finished job, ``life.RESULT_TTL`` is 0), the plan's tokens a batch and the ledger's size
a batch (``done_info``).
"""

from __future__ import annotations

import redis

from hsx import life
from hsx.life import RunKeys, records


def host_upload_rate(r: redis.Redis, run: str, host: str, tokens_of: dict[str, int], now: float,
                     window: float) -> dict:
    """Uploads of ``run`` finished by ``host``'s uploaders in the last ``window`` s (the run's rate span):
    ``{upload_batches_per_s, upload_tokens_per_s, upload_bytes_per_s}``; ``tokens_of``: batch id -> tokens."""
    bids = set(life.uploaded_since(r, run, host, now - window))
    key = RunKeys(run).done_info
    sizes = r.hmget(key, sorted(bids)) if bids else []
    infos = (records.decode(s, key, [], records.DONE_INFO, ("size",)) for s in sizes if s)
    nbytes = sum(info["size"] for info in infos if info)  # a malformed done record adds nothing to the rate
    return {"upload_batches_per_s": len(bids) / window,
            "upload_tokens_per_s": sum(tokens_of.get(b, 0) for b in bids) / window,
            "upload_bytes_per_s": nbytes / window}
