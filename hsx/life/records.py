"""Reading hsx's records in Redis without trusting their shape: what status, the dashboard and /metrics read.

Anyone who can write to Redis (or a half-applied write, or an older hsx) can leave a record that is
not what hsx writes: a heartbeat that is not JSON, a counter that is not an integer, a failure record
without ``attempts``. One such record must not take down `hsx status`, /api/status or /metrics. The
readers here skip it (or, for failure records, whose batch id still matters, keep a placeholder) and
append one line naming it to ``malformed`` (``"<key> <field>: <what is wrong>"``), which the views
count and show.

A shape is ``{field: types}``: a field present must have one of the types (``None`` in the tuple
allows null); ``required`` fields must be present.
"""

from __future__ import annotations

import json

import redis

from hsx.redisconn import text

NUMBER = (int, float)
FAILURE = {"attempts": (int,), "last_error": (str,), "ts": (*NUMBER, type(None))}
FAILURE_REQUIRED = ("attempts", "last_error")
SPEC = {"samples": (int,), "tokens": (int,), "shard": (str,)}
SPEC_REQUIRED = ("samples", "tokens", "shard")
HOST = {"spool_bytes": NUMBER, "spool_files": (int,), "spool_budget_bytes": (*NUMBER, type(None)), "ts": NUMBER}
DONE_INFO = {"size": (int,)}
ERROR_LOG = {"batch": (str,), "error": (str,), "attempts": (int,), "ts": NUMBER, "lost_worker": (str,)}  # the last: a reap's
_OPT_NUMBER = (*NUMBER, type(None))
_OPT_STR = (str, type(None))
HEARTBEAT = {"ts": NUMBER, "batches": (int,), "tokens": (int,), "tokens_per_s": NUMBER, "host": _OPT_STR,
             "device": _OPT_STR, "current_batch": _OPT_STR, "note": _OPT_STR, "name": _OPT_STR, "gpu": (int, type(None)),
             "util_pct": _OPT_NUMBER, "mem_used_bytes": _OPT_NUMBER, "mem_total_bytes": _OPT_NUMBER,
             "temp_c": _OPT_NUMBER, "power_w": _OPT_NUMBER, "stopped": _OPT_NUMBER}


def name(value: bytes | str) -> str:
    """A key or field name as text; bytes that are not UTF-8 are shown with replacement characters."""
    return text(value)


def problem(value, shape: dict, required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a decoded record for ``shape``, or None."""
    if not isinstance(value, dict):
        return f"not a JSON object ({type(value).__name__})"
    for field in required:
        if field not in value:
            return f"no {field!r}"
    for field, types in shape.items():
        if field in value and (not isinstance(value[field], types) or isinstance(value[field], bool)):
            return f"{field!r} is {value[field]!r:.40}"
    return None


def decode(raw, where: str, malformed: list[str], shape: dict, required: tuple[str, ...] = ()) -> dict | None:
    """``raw`` (JSON bytes) as a dict of ``shape``, or None with a line added to ``malformed``."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        malformed.append(f"{where}: not JSON")
        return None
    wrong = problem(value, shape, required)
    if wrong:
        malformed.append(f"{where}: {wrong}")
        return None
    return value


def int_hash(r: redis.Redis, key: str, malformed: list[str]) -> dict[str, int]:
    """A HASH of integer counters; a field that is not an integer is skipped."""
    out = {}
    for field, raw in r.hgetall(key).items():
        try:
            out[name(field)] = int(raw)
        except ValueError:
            malformed.append(f"{key} {name(field)}: not an integer")
    return out


def json_hash(r: redis.Redis, key: str, malformed: list[str], shape: dict,
              required: tuple[str, ...] = ()) -> dict[str, dict]:
    """A HASH of JSON records of ``shape``; a record that is not is skipped."""
    out = {}
    for field, raw in r.hscan_iter(key, count=1000):
        value = decode(raw, f"{key} {name(field)}", malformed, shape, required)
        if value is not None:
            out[name(field)] = value
    return out


def failure_hash(r: redis.Redis, key: str, malformed: list[str]) -> dict[str, dict]:
    """Failure / dead-letter records by batch id. A malformed one is kept as a placeholder (its batch
    still failed, and retry takes it): ``{"attempts": 0, "last_error": "(malformed record: ...)",
    "ts": None, "malformed": True}``."""
    out = {}
    for field, raw in r.hscan_iter(key, count=1000):
        bid, seen = name(field), len(malformed)
        value = decode(raw, f"{key} {bid}", malformed, FAILURE, FAILURE_REQUIRED)
        out[bid] = value if value is not None else {
            "attempts": 0, "last_error": f"(malformed record: {malformed[seen].partition(': ')[2]})", "ts": None,
            "malformed": True}
    return out
