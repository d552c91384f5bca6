"""Uploads a host refuses (spool mismatch, a store it cannot see): recorded per run for `hsx status`.

The uploader that refuses a job puts it back and records the cause here; its next verified
upload for the run clears the record. Key: RunKeys.upload_refused (HASH host -> JSON).
"""

from __future__ import annotations

import json
import time

import redis

from hsx.life import RunKeys
from hsx.redisconn import json_hash


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


def lines(r: redis.Redis, run: str) -> list[str]:
    """One line a refusing host: "uploads refused: spool mismatch on host h3 (4 jobs put back): ..."."""
    return [f"uploads refused: {v.get('cause')} on host {h} ({v.get('jobs', 0)} jobs put back): {v.get('message', '')}"
            for h, v in sorted(refused_uploads(r, run).items())]
