"""A run's notices: the records its roles leave for `hsx status` and the dashboard, beside the ledger.

- ``store_refusal`` (STRING JSON ``{error, batch, ts, by}``): an uploader met a permanent store error (403
  AccessDenied, NoSuchBucket, an object whose sha256 metadata the store dropped). Shown until an upload of the
  run is verified again; the batch counts the failure against its attempts meanwhile, so nothing is retried
  forever unseen.
- ``upload_refused`` (HASH host -> JSON ``{cause, message, jobs, ts}``): a host's uploader refused a job (spool
  mismatch, a store it cannot see) and put it back; its next verified upload of the run clears it.
- ``evaluation`` (STRING JSON, last writer wins): the summary of the last `hsx evaluate` of a drafter trained on
  the run (hsx/monitor/evaluation.py makes it from the report; ``EVALUATION_FIELDS``, any may be None).
"""

from __future__ import annotations

import json
import time

import redis

from hsx.life import records
from hsx.life.keys import RunKeys
from hsx.redisconn import json_hash

EVALUATION_FIELDS = ("drafter", "global_step", "tau", "target_forwards_per_token", "speedup", "identical_prompts",
                     "prompts", "teacher_forced_accepted_prefix", "device", "ts")
EVALUATION_SHAPE = {f: (str, type(None)) if f in ("drafter", "device") else (*records.NUMBER, type(None))
                    for f in EVALUATION_FIELDS}


def record_store_refusal(r: redis.Redis, run: str, bid: str, error: str, by: str) -> None:
    r.set(RunKeys(run).store_refusal, json.dumps({"error": error[-1000:], "batch": bid, "ts": time.time(), "by": by}))


def clear_store_refusal(r: redis.Redis, run: str) -> None:
    r.delete(RunKeys(run).store_refusal)


def store_refusal(r: redis.Redis, run: str) -> dict | None:
    raw = r.get(RunKeys(run).store_refusal)
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def record_refused_upload(r: redis.Redis, run: str, host: str, cause: str, message: str) -> None:
    key = RunKeys(run).upload_refused
    raw = r.hget(key, host)
    jobs = (json.loads(raw).get("jobs", 0) if raw else 0) + 1
    r.hset(key, host, json.dumps({"cause": cause, "message": message[:500], "jobs": jobs, "ts": time.time()}))


def clear_refused_uploads(r: redis.Redis, run: str, host: str) -> None:
    r.hdel(RunKeys(run).upload_refused, host)


def refused_uploads(r: redis.Redis, run: str) -> dict[str, dict]:
    """{host: {cause, message, jobs, ts}}; a malformed entry is skipped."""
    try:
        return {h: v for h, v in json_hash(r, RunKeys(run).upload_refused).items() if isinstance(v, dict)}
    except ValueError:
        return {}


def record_evaluation(r: redis.Redis, run: str, entry: dict) -> None:
    r.set(RunKeys(run).evaluation, json.dumps({f: entry.get(f) for f in EVALUATION_FIELDS}))


def evaluation(r: redis.Redis, run: str, malformed: list[str] | None = None) -> dict | None:
    """The run's evaluation summary, or None (none made, or a record hsx did not write: named in ``malformed``)."""
    key = RunKeys(run).evaluation
    raw = r.get(key)
    return None if raw is None else records.decode(raw, key, [] if malformed is None else malformed,
                                                   EVALUATION_SHAPE, EVALUATION_FIELDS)
