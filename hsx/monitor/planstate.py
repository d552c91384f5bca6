"""Whether a run's plan is whole, and if not, who is planning it or how to resume it; the plan
and its planned total, read warily, for the dashboard's plan summary (cached once the plan is whole).

`hsx produce` plans a run window by window and keeps ``planning: 1`` in the run's totals until the last
window is enqueued. A producer killed halfway leaves it so: the totals then count only the windows planned
so far, so a batch total, a "complete" and an ETA read from them would be wrong. `hsx status` and the
dashboard show this record instead of an ETA.
"""

from __future__ import annotations

import json
import shlex

import redis

from hsx import defaults as D
from hsx import life
from hsx.life import RunKeys, records
from hsx.runspec import Manifest


def lock_holder(r: redis.Redis, run: str) -> dict | None:
    """The producer holding the run's lock ({"host", "pid"}), or None when none does (its TTL frees it
    within 30 s of the producer's death). A lock value hsx did not write is named as it is."""
    raw = r.get(RunKeys(run).producer_lock)
    if raw is None:
        return None
    try:
        token = json.loads(raw)
        return {"host": str(token["host"]), "pid": int(token["pid"])}
    except (ValueError, TypeError, KeyError):
        return {"host": "unknown", "pid": None}


def resume_command(manifest: Manifest | None, run: str) -> str:
    """The `hsx produce` command that resumes the run: the manifest's settings, defaults left out (another
    value of any of them is another run, which produce refuses)."""
    if manifest is None:
        return f"hsx produce --run {shlex.quote(run)} (with the dataset, model and settings it was planned with)"
    m = manifest
    sources = [s["dataset"] for s in m.mixture]
    given = (["--dataset", m.dataset] if not sources else   # a mixture: its file, or each --dataset given
             [x for path in sources for x in ("--dataset", path)] if m.dataset == sources[0] else ["--mixture", m.dataset])
    args = ["hsx", "produce", "--run", run, *given, "--model", m.model, "--layers", m.layer_preset,
            "--store", m.store_url]
    optional = [("--s3-endpoint-url", m.store.endpoint_url, None), ("--s3-region", m.store.region, None),
                ("--s3-addressing-style", m.store.addressing_style, "auto"),
                ("--max-length", m.max_length, D.DEFAULT_MAX_LENGTH), ("--overlong", m.overlong, "drop"),
                ("--token-budget", m.token_budget, D.DEFAULT_TOKEN_BUDGET),
                ("--max-batch-rows", m.max_batch_rows, D.DEFAULT_MAX_BATCH_ROWS),
                ("--pad-multiple", m.pad_multiple, D.DEFAULT_PAD_MULTIPLE), ("--dtype", m.dtype, D.DEFAULT_DTYPE),
                ("--store-dtype", m.store_dtype, m.dtype), ("--codec", m.codec, "none"),
                ("--compute-dtype", m.compute_dtype, "bfloat16"),
                ("--fp8-accumulation", m.fp8_accumulation,
                 m.fp8_accumulation if m.compute_dtype != "float8" else D.DEFAULT_FP8_ACCUMULATION),
                ("--window-rows", m.window_rows, D.DEFAULT_WINDOW_ROWS if m.window_rows is not None else None),
                ("--max-attempts", m.limits.max_attempts, D.DEFAULT_MAX_ATTEMPTS),
                ("--lease-seconds", m.limits.lease_seconds, D.DEFAULT_LEASE_SECONDS)]
    for flag, value, default in optional:
        if value is not None and value != default:
            args += [flag, str(value)]
    if m.template_kwargs:
        args += ["--template-kwargs", json.dumps(dict(m.template_kwargs), separators=(",", ":"), sort_keys=True)]
    command = shlex.join(args)
    if m.columns:  # a mapping file or key=col list, as given then: the manifest keeps it as JSON
        command += " --columns MAPPING (the instruction-column mapping it was planned with, in its manifest)"
    return command


def plan_state(r: redis.Redis, run: str, totals: dict, manifest: Manifest | None) -> dict | None:
    """None while the plan is whole (or not begun); else ``{"windows", "batches", "rows", "producer",
    "resume"}``: windows and batches planned so far, the producer holding the lock (None: none does, the
    planning stopped) and the command that resumes it."""
    if not totals.get("planning"):
        return None
    holder = lock_holder(r, run)
    return {"windows": r.hlen(RunKeys(run).windows), "batches": totals.get("batches", 0), "rows": totals.get("rows"),
            "producer": holder, "resume": resume_command(manifest, run)}


def plan_entries(r: redis.Redis, run: str, malformed: list[str]) -> dict[str, dict]:
    """The plan, batch id -> its spec as a record ({samples, tokens, shard, ...}, hsx.life.records.SPEC); an
    entry that is not one is skipped and named in ``malformed``."""
    return records.json_hash(r, RunKeys(run).plan, malformed, records.SPEC, records.SPEC_REQUIRED)


def plan_tokens(r: redis.Redis, run: str, bids: list[str], malformed: list[str]) -> dict[str, int]:
    """Tokens of the batches ``bids`` from their plan entries (one HMGET); an entry that is not a record is left out
    and named in ``malformed`` (once)."""
    key, out = RunKeys(run).plan, {}
    for bid, raw in zip(bids, r.hmget(key, bids) if bids else [], strict=True):
        where = f"{key} {records.name(bid)}"
        seen: list[str] = []
        spec = records.decode(raw, where, seen, records.SPEC, records.SPEC_REQUIRED) if raw else None
        malformed.extend(m for m in seen if m not in malformed)
        if spec:
            out[bid] = spec["tokens"]
    return out


def window_spans(r: redis.Redis, run: str) -> list[range] | None:
    """The batch ranges of the run's window records (O(windows)), or None if one is not a record hsx writes."""
    spans = []
    for raw in life.Run(r, run).window_records().values():
        try:
            rec = json.loads(raw)
            first, batches = int(rec["first_batch"]), int(rec["batches"])
        except (ValueError, KeyError, TypeError):
            return None
        spans.append(range(first, first + batches))
    return sorted(spans, key=lambda s: s.start)


def planned_batches(r: redis.Redis, run: str) -> int | None:
    """The batches the run's totals say are planned (None: not recorded yet, or not an integer, which
    run_progress names as a malformed record)."""
    return records.int_hash(r, RunKeys(run).totals, []).get("batches")


def plan_line(state: dict) -> str:
    """The `hsx status` line of an unfinished plan."""
    so_far = (f"{state['batches']} batches from {state['rows']} rows" if state.get("rows") is not None
              else f"{state['batches']} batches") + f" ({state['windows']} windows) planned so far"
    holder = state.get("producer")
    if holder is not None:
        return (f"  PLANNING unfinished: {so_far}; producer pid {holder['pid']} on host {holder['host']} is planning "
                "(the totals and the ETA wait for the whole plan)")
    return (f"  PLANNING unfinished: {so_far}, and no producer holds the run (stopped or killed); "
            f"resume it with: {state['resume']}")
