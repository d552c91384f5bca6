"""The run's flag for a store that refuses for good.

An uploader that meets a permanent store error (403 AccessDenied, NoSuchBucket,
an object whose sha256 metadata the store dropped) records the store's message
here; `hsx status`, the dashboard's /api/status (``store_refusal``) and /metrics
(``hsx_store_refusing``) show it until an upload of the run is verified again.
The batch itself counts the failure against its attempts (dead letter at the
run's ``max_attempts``), so nothing is retried forever unseen.
"""

from __future__ import annotations

import json
import time

from hsx.life import RunKeys


def record_store_refusal(r, run: str, bid: str, error: str, by: str) -> None:
    r.set(RunKeys(run).store_refusal, json.dumps({"error": error[-1000:], "batch": bid, "ts": time.time(), "by": by}))


def clear_store_refusal(r, run: str) -> None:
    r.delete(RunKeys(run).store_refusal)


def store_refusal(r, run: str) -> dict | None:
    raw = r.get(RunKeys(run).store_refusal)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
