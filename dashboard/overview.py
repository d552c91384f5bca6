"""One run's overview: the numbers the page, /api/status and /metrics all show.

Built from ``hsx.monitor.progress.run_progress`` (ledger, counters, heartbeats, hosts)
plus the plan (per-shard totals, tokens a batch) and rq (upload queue depth,
uploaders, uploads finished a host). Plain JSON-ready dicts; nothing here
writes to Redis.
"""

from __future__ import annotations

import time

import redis

from dashboard.config import DEFAULT_RECENT_ERRORS, DashboardConfig
from dashboard.plan_cache import PlanCache, PlanSummary
from hsx import life, monitor
from hsx.monitor import RATE_WINDOW_SECONDS, host_row, host_upload_rate, last_activity, run_progress, throughput_series

# Worker states, the words of every view (hsx/life/heartbeat.py): "alive" (a fresh heartbeat; its "activity":
# "busy", a batch in hand, or "idle"), "stopped" (it stopped cleanly: its counts are final), "lost" (its heartbeat
# ran out without a stop, or is older than stale_after_seconds: killed, host gone, cut off).
GPU_FIELDS = ("gpu", "name", "util_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w")


def pick_run(r: redis.Redis, requested: str | None) -> tuple[str | None, list[str]]:
    """(the run to show, all runs). Default: the run with the latest extract/upload activity."""
    runs = life.Run.names(r)
    if requested:
        return (requested if requested in runs else None), runs
    return (max(runs, key=lambda run: (last_activity(r, run), run)) if runs else None), runs


def _reclaimed(errors: list[dict]) -> dict[str, list[str]]:
    """worker name -> batches reclaimed from it after it stopped beating: the reaper's record names it
    (``lost_worker``, hsx.life.batchlife.reap); a record of an older hsx, without it, in its error's words."""
    out: dict[str, list[str]] = {}
    for e in errors:
        name = e.get("lost_worker") or _lost_worker_in_words(e["error"])
        if name and e["batch"] not in out.get(name, []):
            out.setdefault(name, []).append(e["batch"])
    return out


def _lost_worker_in_words(error: str) -> str | None:
    """The worker an older hsx's reaper named in its error ("worker lost: NAME [on host H] stopped beating ...")."""
    if error.startswith("worker lost: ") and " stopped beating" in error:
        return error.removeprefix("worker lost: ").split(" ", 1)[0]
    return None


def _worker_row(w: dict, now: float, stale_after: float, reclaimed: dict[str, list[str]]) -> dict:
    age = now - w.get("ts", w["last_seen"])
    state = w["state"]
    if state == "alive" and age > stale_after:  # its key lives, but it has not beaten for too long
        state = "lost"
    alive = state == "alive"
    row = {"worker": w["worker"], "host": w.get("host"), "device": w.get("device"), "state": state,
           "activity": ("busy" if w.get("current_batch") else "idle") if alive else None,
           "heartbeat_age_seconds": round(age, 1), "current_batch": w.get("current_batch") if alive else None,
           "last_batch": w.get("last_batch"), "reclaimed": reclaimed.get(w["worker"], []),
           "batches": w.get("batches", 0), "tokens": w.get("tokens", 0), "tokens_per_s": w.get("tokens_per_s", 0.0),
           "gpu_note": w.get("note")}
    row.update({f: w.get(f) for f in GPU_FIELDS})
    row["gpu_name"] = row.pop("name")
    return row


def _host_row(r: redis.Redis, run: str, host: str, stats: dict, plan: PlanSummary, now: float, span: float) -> dict:
    row = host_row(r, host, stats, now)
    row.update(host_upload_rate(r, run, host, plan.tokens, now, span))
    return row


def _failure_rows(records: dict[str, dict], dead: bool) -> list[dict]:
    return [{"batch_id": bid, "attempts": rec.get("attempts"), "last_error": rec.get("last_error", ""),
             "ts": rec.get("ts"), "dead": dead, "resolved": False} for bid, rec in records.items()]


def _resolved_rows(run: life.Run, errors: list[dict]) -> list[dict]:
    """Failures of batches done since (the error log, hsx.life.errorlog): a worker lost mid-batch stays in sight."""
    if not errors:
        return []
    bids = list(dict.fromkeys(e["batch"] for e in errors))
    done = run.done_among(bids)
    return [{"batch_id": e["batch"], "attempts": e.get("attempts"), "last_error": e["error"], "ts": e["ts"],
             "dead": False, "resolved": True} for e in errors if e["batch"] in done]


def build_overview(r: redis.Redis, run: str, config: DashboardConfig, plans: PlanCache, now: float | None = None,
                   window: float = RATE_WINDOW_SECONDS) -> dict:
    now = now or time.time()
    ledger = life.Run(r, run)
    p = run_progress(r, run, now=now, window=window)
    plan = plans.get(r, run)
    totals, done = p["totals"], p["done"]
    dead = sorted(_failure_rows(p["dead_letters"], True), key=lambda f: f["batch_id"])
    errors = ledger.recent_failures(p["malformed"])
    recent = sorted(dead + _failure_rows(p["failures"], False) + _resolved_rows(ledger, errors),
                    key=lambda f: -(f["ts"] or 0))
    reclaimed = _reclaimed(errors)
    return {
        "run": run,
        "generated_at": now,
        "complete": p["complete"],
        "index_written": p["index_written"],
        "started": p["started"],
        "progress": {
            "samples": {"done": done["samples"], "total": totals.get("samples", 0)},
            "tokens": {"done": done["tokens"], "total": totals.get("tokens", 0)},
            "batches_extracted": {"done": p["spooled_batches"], "total": totals.get("batches", 0)},
            "batches_uploaded": {"done": done["batches"], "total": totals.get("batches", 0)},
        },
        "uploaded_bytes": done["bytes"],
        "written_bytes": p["written_bytes"],
        "bytes_per_token": p["bytes_per_token"],
        "store_dtype": p["store_dtype"],
        "codec": p["codec"],
        "compute_dtype": p["compute_dtype"],
        "prefix": p["prefix"],   # {reuse: on|off, stored_tokens, computed_tokens}: planned (hsx.monitor.progress)
        "fidelity": p["fidelity"],  # {layer_ids, compute, store}: FP8's measured error per stored layer (hsx.progress)
        "rate": {"window_seconds": p["rate_span_seconds"], "samples_per_s": p["rate"]["samples"],
                 "tokens_per_s": p["rate"]["tokens"],
                 "batches_per_s": p["rate"]["batches"], "extract_tokens_per_s": p["extract_rate"]["tokens"],
                 "extract_batches_per_s": p["extract_rate"]["batches"]},
        "eta_seconds": p["eta_seconds"],
        "stalled": p["stalled"],           # why a run with work left is not moving (None if it is)
        # the plan is not whole: {windows, batches, rows, producer, resume, line} (hsx.monitor.planstate), None once it is
        "planning": {**p["planning"], "line": monitor.plan_line(p["planning"]).strip()} if p["planning"] else None,
        "store_refusal": p["store_refusal"],  # {error, batch, ts, by}: the store refuses uploads for good (None if not)
        "upload_refused": p["upload_refused"],  # {host: {cause, message, jobs, ts}}: uploaders that put jobs back
        "extract_queue": p["extract_queue"],
        "series": throughput_series(r, run, plan.tokens, now, p["complete"], config.series_span_seconds,
                                    config.series_bucket_seconds, p["malformed"]),
        # a mixture's sources: rows, rejected, samples, tokens, batches planned and done each ([] for one dataset)
        "sources": monitor.source_progress(r, run, plan.samples, plan.tokens),
        "shards": [{"shard": s, "done": p["shards"].get(s, {}).get("done", 0), "total": n}
                   for s, n in sorted(plan.shard_batches.items())],
        "workers": sorted((_worker_row(w, now, config.stale_after_seconds, reclaimed)
                           for w in p["workers"]),
                          key=lambda w: (w["host"] or "", w["gpu"] if w["gpu"] is not None else -1, w["worker"])),
        "hosts": [_host_row(r, run, h, s, plan, now, p["rate_span_seconds"]) for h, s in sorted(p["hosts"].items())],
        "dead_letters": dead,
        "retrying": len(p["failures"]),
        "recent_errors": recent[:DEFAULT_RECENT_ERRORS],
        "malformed": list(dict.fromkeys([*p["malformed"], *plan.malformed])),  # records skipped (hsx.life.records), "<key> <field>: why"
    }
