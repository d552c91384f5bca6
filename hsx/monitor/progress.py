"""Progress of a run, from the ledger: what `hsx status`, the dashboard and /metrics show."""

from __future__ import annotations

import time

import redis

from hsx import life
from hsx.life import RunKeys, records
from hsx.monitor import evaluation, planstate
from hsx.monitor.minutes import window_counts
from hsx.runspec import Manifest, ManifestError

RATE_WINDOW_SECONDS = 300  # rates are averaged over the last five minutes...
MIN_RATE_SPAN_SECONDS = 10  # ...or, for a run younger than that, over its age (at least this long)
STALL_SECONDS = 120  # a run with work left, no lease held and nothing spooled or done this long is "stalled"
# Two counts that differ (a SLURM task logged 62 batches while status said 51): which is which.
WORKER_COUNTS = ("a worker's count: batches it extracted, as of its last report; the run's: batches verified in "
                 "the store")


def rate_span(r: redis.Redis, run: str, now: float, window: float = RATE_WINDOW_SECONDS) -> float:
    """Seconds rates are averaged over: ``window``, or the run's age since its first batch reached a
    spool or the ledger if that is shorter (so a young run's rate and ETA are not diluted)."""
    firsts = [first for kind in ("spooled", "done") if (first := _first(r, run, kind)) is not None]
    if not firsts:
        return window
    return min(window, max(now - min(firsts), MIN_RATE_SPAN_SECONDS))


def _first(r: redis.Redis, run: str, kind: str) -> float | None:
    """Unix time the run's first batch was ``kind`` (spooled | done): its mark in rate_minutes, else (an older hsx's
    run, whose logs hold every batch) the log's first entry; None: none yet."""
    keys = RunKeys(run)
    mark = r.hget(keys.rate_minutes, f"{kind}:first")
    try:
        return float(mark) if mark is not None else None
    except ValueError:
        pass   # not a time: the log says
    log_key = keys.done_log if kind == "done" else keys.spooled_log
    first = r.zrange(log_key, 0, 0, withscores=True)
    return first[0][1] if first else None


def _spooled_count(r: redis.Redis, run: str) -> int:
    """Batches of the run that reached a spool: the count in rate_minutes, else (an older hsx's run) its log's."""
    keys = RunKeys(run)
    count = r.hget(keys.rate_minutes, "spooled:count")
    try:
        return int(count) if count is not None else r.zcard(keys.spooled_log)
    except ValueError:
        return r.zcard(keys.spooled_log)


def _minutes(r: redis.Redis, run: str, kind: str, now: float, window: float) -> dict | None:
    """Batches, samples and tokens ``kind`` (spooled | done) in the last ``window`` s from the run's per-minute
    counts (one HMGET of 3 fields a minute; the oldest minute counted by the share of it inside the window); None
    for a run without them (recorded by an older hsx)."""
    key = RunKeys(run).rate_minutes
    if not r.exists(key):
        return None
    return dict(zip(("batches", "samples", "tokens"), window_counts(r, key, kind, "bst", now, window), strict=True))


def _window(r: redis.Redis, run: str, log_key: str, now: float, window: float, span: float | None = None,
            malformed: list[str] | None = None) -> dict:
    span = span or window
    kind = "done" if log_key == RunKeys(run).done_log else "spooled"
    counted = _minutes(r, run, kind, now, window)
    if counted is not None:
        return {**counted, "per_s": {k: v / span for k, v in counted.items()}}
    members = r.zrangebyscore(log_key, now - window, now, withscores=True)
    if not members:
        return {"batches": 0, "samples": 0, "tokens": 0, "per_s": {"batches": 0.0, "samples": 0.0, "tokens": 0.0}}
    plan_key = RunKeys(run).plan
    specs = r.hmget(plan_key, [m for m, _ in members])
    samples = tokens = 0
    seen: list[str] = []
    for (bid, _), raw in zip(members, specs, strict=True):
        spec = records.decode(raw, f"{plan_key} {records.name(bid)}", seen, records.SPEC, records.SPEC_REQUIRED) \
            if raw else None
        if spec:
            samples += spec["samples"]
            tokens += spec["tokens"]
    if malformed is not None:
        malformed.extend(m for m in seen if m not in malformed)  # the two windows read the same plan entries
    return {"batches": len(members), "samples": samples, "tokens": tokens,
            "per_s": {"batches": len(members) / span, "samples": samples / span, "tokens": tokens / span}}


def _not_done(r: redis.Redis, keys: RunKeys, records_by_batch: dict[str, dict]) -> dict[str, dict]:
    """Failure records without the batches that are done (a done batch failed nothing: the ledger
    drops such records in mark_done and `hsx produce`; one written by an older hsx is not shown)."""
    if not records_by_batch:
        return records_by_batch
    done = life.Run(r, keys.run).done_among(list(records_by_batch))
    return {b: rec for b, rec in records_by_batch.items() if b not in done}


def fidelity(r: redis.Redis, run: str, malformed: list[str]) -> dict | None:
    """FP8's measured error against bf16, per stored layer: ``{"layer_ids", "compute", "store"}`` with
    ``compute`` the run's record (hsx/life/computeerror.py: one batch, measured once) and ``store`` the summary
    of the sampled batches (hsx/life/storeerror.py), each None where not measured; None for a run with neither."""
    ledger = life.Run(r, run)
    compute, store = ledger.compute_error(malformed), ledger.store_error_summary(malformed)
    if compute is None and store is None:
        return None
    layer_ids = list((compute or {}).get("layer_ids", []))
    layer_ids += [x for x in (store or {}).get("layer_ids", []) if x not in layer_ids]
    return {"layer_ids": layer_ids, "compute": compute, "store": store}


def fidelity_lines(f: dict) -> list[str]:
    """The fidelity block of `hsx status`: one row a stored layer, FP8 compute next to FP8 storage."""
    compute, store = f["compute"], f["store"]

    def cell(record, layer, rel_key, cos_key):
        if record is None or layer not in record["layer_ids"]:
            return "-"
        i = record["layer_ids"].index(layer)
        return f"{record[rel_key][i]:.4f} / {record[cos_key][i]:.5f}"

    lines = ["  fidelity against bf16, per stored layer (rel L2 / mean cosine over tokens):",
             f"    {'layer':<7}{'FP8 compute':<22}{'FP8 storage (mean)':<22}FP8 storage (worst batch)"]
    for layer in f["layer_ids"]:
        lines.append(f"    {layer!s:<7}{cell(compute, layer, 'rel_l2', 'cosine'):<22}"
                     f"{cell(store, layer, 'rel_l2_mean', 'cosine_mean'):<22}"
                     f"{cell(store, layer, 'rel_l2_max', 'cosine_min')}")
    if compute is not None:
        accumulation = f", {str(compute['accumulation'])[:8]} accumulation" if compute.get("accumulation") else ""
        lines.append(f"    compute: batch {compute.get('batch_id')} ({compute.get('tokens')} tokens, once per run"
                     f"{accumulation}), against {str(compute.get('reference'))[:200]}")
    if store is not None:
        lines.append(f"    storage: {store['batches_measured']} batches ({store['tokens_measured']} tokens), one in "
                     f"{life.Run.ERROR_SAMPLE_EVERY} a worker runs")
    return lines


def _manifest(raw: bytes, where: str, malformed: list[str]) -> Manifest | None:
    """The run's manifest, or None with a line in ``malformed`` (a view never fails on one bad record)."""
    try:
        return Manifest.from_json(raw, records.name(where))
    except ManifestError as exc:
        malformed.append(str(exc))
        return None


def _prefix_line(prefix: dict) -> str:
    stored, computed = prefix["stored_tokens"], prefix["computed_tokens"]
    how = ("shared prefixes once" if prefix["reuse"] == "on" else "--prefix-reuse off") + ", padding in"
    return (f"  computed {computed} tokens planned for {stored} stored ({how}"
            + (f"; {stored / computed:.2f} stored a computed token)" if computed else ")"))


def run_progress(r: redis.Redis, run: str, now: float | None = None, window: float = RATE_WINDOW_SECONDS) -> dict:
    """The run's progress. A record that is not what hsx writes is skipped (a failure record is kept as
    a placeholder) and named under ``"malformed"`` (hsx.life.records): one bad record never fails the read."""
    ledger = life.Run(r, run)
    keys = ledger.keys
    now = now or time.time()
    malformed: list[str] = []
    totals, done = records.int_hash(r, keys.totals, malformed), records.int_hash(r, keys.counters, malformed)
    spooled = _spooled_count(r, run)
    span = rate_span(r, run, now, window)
    rate = _window(r, run, keys.done_log, now, window, span, malformed)
    remaining_tokens = max(totals.get("tokens", 0) - done.get("tokens", 0), 0)
    tok_rate = rate["per_s"]["tokens"]
    eta = remaining_tokens / tok_rate if tok_rate > 0 else None
    complete = not totals.get("planning", 0) and totals.get("batches", -1) == done.get("batches", 0)
    started = _first(r, run, "done")
    raw_manifest = r.get(keys.manifest)
    manifest = _manifest(raw_manifest, keys.manifest, malformed) if raw_manifest else None
    workers = ledger.read_workers(malformed)
    extract_queue = len(ledger.extract_queue())
    dead = _not_done(r, keys, ledger.dead_letters(malformed))
    failures = _not_done(r, keys, ledger.failures(malformed))
    planned_only = bool(r.exists(keys.planned_only))
    stalled = None if complete or planned_only else stall_reason(r, run, now, totals, done, extract_queue, workers, dead)
    hosts = ledger.read_hosts(malformed)
    upload_refused = {} if complete else ledger.refused_uploads()
    if upload_refused:  # the cause a person must fix, before any generic "nothing moved"
        stalled = "; ".join(f"uploads refused: {v.get('cause')} on host {h}" for h, v in sorted(upload_refused.items()))
    fp8 = fidelity(r, run, malformed)
    planning = planstate.plan_state(r, run, totals, manifest)  # None once the plan is whole
    return {
        "run": run,
        "totals": totals,
        "done": {k: done.get(k, 0) for k in ("batches", "samples", "tokens", "bytes")},
        "spooled_batches": spooled,
        "written_bytes": done.get(life.Run.WRITTEN_BYTES, 0),
        "bytes_per_token": (done["bytes"] / done["tokens"]) if done.get("tokens") and done.get("bytes") else None,
        "store_dtype": manifest.store_dtype if manifest else None,
        "codec": manifest.codec if manifest else "none",
        "compute_dtype": manifest.compute_dtype if manifest else "bfloat16",
        # planned tokens stored against what the GPU computes (padding in, each shared prefix once)
        "prefix": {"reuse": manifest.prefix_reuse if manifest else "off", "stored_tokens": totals.get("tokens", 0),
                   "computed_tokens": totals.get("computed_tokens") or totals.get("padded_tokens", 0),
                   # a worker's check of one batch: its shared-prefix samples against the same alone (or None)
                   "check": ledger.prefix_error(malformed)},
        "evaluation": ledger.evaluation(malformed),  # the last `hsx evaluate` of a drafter of this run, or None
        "fidelity": fp8,  # FP8 compute and storage error per stored layer (None: a bf16 run, or not measured yet)
        "rate": rate["per_s"],
        "extract_rate": _window(r, run, keys.spooled_log, now, window, span, malformed)["per_s"],
        "rate_span_seconds": span,
        "eta_seconds": 0.0 if complete else (None if stalled or planning else eta),  # unknown until the plan is whole
        "planning": planning,  # {windows, batches, rows, producer, resume}: the plan is not whole yet (hsx.monitor.planstate)
        "complete": complete,
        "started": started,
        "shards": {k: {"done": v} for k, v in records.int_hash(r, keys.shard_done, malformed).items()},
        "failures": failures,
        "dead_letters": dead,
        "extract_queue": extract_queue,
        "workers": workers,
        "stalled": stalled,
        "planned_only": planned_only,  # `hsx produce --no-enqueue`: nothing is enqueued until the user starts it
        "upload_refused": upload_refused,
        "hosts": hosts,
        "index_written": bool(r.get(keys.index_written)),
        "malformed": malformed,
        "store_refusal": None if complete else ledger.store_refusal(),  # {error, batch, ts, by}: store says no
    }


def host_row(r: redis.Redis, host: str, stats: dict, now: float | None = None) -> dict:
    """One host of a run: its spool against the budget (as its workers last reported) and its upload queue.

    The one builder of these rows: `hsx status --watch` and the dashboard both show them.
    """
    from rq import Worker

    now = time.time() if now is None else now
    q = life.queue(r, life.upload_queue_name(host))
    budget = stats.get("spool_budget_bytes") or 0
    used = stats.get("spool_bytes", 0)
    return {"host": host, "spool_bytes": used, "spool_files": stats.get("spool_files", 0),
            "spool_budget_bytes": budget, "spool_fill": (used / budget) if budget else None,
            "reported_age_seconds": round(now - stats.get("ts", now), 1),
            "upload_queue": q.count, "uploaders": len(Worker.all(connection=r, queue=q))}


def stall_reason(r: redis.Redis, run: str, now: float, totals: dict, done: dict, extract_queue: int,
                 workers: list[dict], dead: dict) -> str | None:
    """Why a run with work left is not moving, or None if something moved in the last STALL_SECONDS
    (a batch spooled or done) or a lease is held (a live process is working on a batch)."""
    keys = RunKeys(run)
    if not totals.get("batches") or totals.get("planning") or r.exists(keys.producer_lock):
        return None  # nothing planned yet, or the producer is still planning / enqueueing
    pipe = r.pipeline(transaction=False)
    pipe.zcount(keys.done_log, now - STALL_SECONDS, "+inf")
    pipe.zcount(keys.spooled_log, now - STALL_SECONDS, "+inf")
    pipe.zcard(keys.extract_leases)
    pipe.zcard(keys.upload_leases)
    if any(pipe.execute()):
        return None
    left = totals["batches"] - done.get("batches", 0)
    alive = sum(1 for w in workers if w.get("alive"))
    ledger = life.Run(r, run)
    lost = len(ledger.orphans())   # a run fed in steps: among the batches a pass would check now
    fed = ledger.fed_count()
    unfed = totals["batches"] - fed if fed is not None else 0
    if not lost and not extract_queue and unfed > 0:
        return (f"{unfed} of {left} batches left are not fed to the queue yet; a running worker or uploader feeds "
                "them within 2 x its lease" + ("" if alive else " (no live worker of this run now)"))
    if lost:
        return (f"{lost} of {left} batches left are in no queue, lease or dead letter; a running worker or uploader "
                "re-enqueues them within 2 x its lease" + ("" if alive else " (no live worker of this run now)"))
    if extract_queue and not alive:
        return f"{extract_queue} batches queued and no live worker of this run"
    if dead and len(dead) >= left:
        return f"only dead letters left ({len(dead)}): hsx retry-failed --run {run}"
    return f"{left} batches left and nothing spooled or done in the last {STALL_SECONDS} s"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def summary_lines(p: dict) -> list[str]:
    t, d = p["totals"], p["done"]

    def pct(a, b):
        return f"{100 * a / b:.1f}%" if b else "-"

    planning = p.get("planning")
    lines = [
        f"run {p['run']}: {'COMPLETE' if p['complete'] else 'in progress'}"
        + (", plan unfinished (totals are what is planned so far)" if planning else ""),
        *([planstate.plan_line(planning)] if planning else []),
        f"  batches  {d['batches']}/{t.get('batches', 0)} done ({pct(d['batches'], t.get('batches', 0))}), "
        f"{p['spooled_batches']} extracted, {p['extract_queue']} queued",
        f"  samples  {d['samples']}/{t.get('samples', 0)} ({pct(d['samples'], t.get('samples', 0))})",
        f"  tokens   {d['tokens']}/{t.get('tokens', 0)} ({pct(d['tokens'], t.get('tokens', 0))})",
        *([_prefix_line(p["prefix"])] if p.get("prefix") else []),
        *([life.Run.prefix_error_line(p["prefix"]["check"])] if (p.get("prefix") or {}).get("check") else []),
        f"  uploaded {fmt_bytes(d['bytes'])}, {fmt_bytes(p['written_bytes'])} written to spools; "
        + (f"{p['bytes_per_token']:.0f} bytes/token" if p["bytes_per_token"] else "bytes/token not known yet")
        + f" ({p['store_dtype']}, codec {p['codec']}"
        + (f", computed in {p['compute_dtype']})" if p.get("compute_dtype", "bfloat16") != "bfloat16" else ")"),
        f"  rate     {p['rate']['samples']:.1f} samples/s, {p['rate']['tokens']:.0f} tokens/s "
        f"(last {fmt_duration(p['rate_span_seconds'])})",
        f"  ETA      {fmt_duration(p['eta_seconds'])}" + (" (until the plan is whole)" if planning else ""),
    ]
    states = [w.get("state") or ("alive" if w.get("alive") else "lost") for w in p["workers"]]
    lines.append(f"  workers  {states.count('alive')} alive, {states.count('stopped')} stopped, {states.count('lost')} "
                 "lost" + (f" ({WORKER_COUNTS})" if any(s != "alive" for s in states) else ""))
    if p.get("planned_only"):
        lines.append(f"  PLANNED ONLY (hsx produce --no-enqueue): no process enqueues its batches; start it with the "
                     f"same `hsx produce ... --run {p['run']}` command without --no-enqueue")
    for w, state in zip(p["workers"], states, strict=True):
        if state != "alive" and w.get("host"):  # a worker that no longer beats: who it was (until swept)
            lines.append(f"    {state} {w['worker']} on host {w['host']}: {w.get('batches', 0)} batches extracted, as "
                         f"of its {'stop' if state == 'stopped' else 'last heartbeat'}; last batch "
                         f"{w.get('last_batch') or '-'}")
    if p.get("stalled"):
        lines.append(f"  STALLED  {p['stalled']}")
    for host, rec in sorted(p.get("upload_refused", {}).items()):
        lines.append(f"  REFUSED  {rec.get('jobs', 0)} upload jobs on host {host}: {rec.get('message', '')[:300]}")
    if p.get("store_refusal"):
        ref = p["store_refusal"]
        lines.append(f"  STORE REFUSES uploads (batch {ref.get('batch')}): {str(ref.get('error'))[:300]}")
    if p.get("fidelity"):
        lines.extend(fidelity_lines(p["fidelity"]))
    if p.get("compute_dtype") == "float8" and not (p.get("fidelity") or {}).get("compute"):
        lines.append("  FP8 compute error not measured yet (the first worker to take a batch measures it, once)")
    if p.get("evaluation"):
        lines.extend(evaluation.lines(p["evaluation"]))
    if p["failures"]:
        lines.append(f"  retrying {len(p['failures'])} batches after failures")
    if p.get("malformed"):
        lines.append(f"  MALFORMED {len(p['malformed'])} records in Redis that hsx did not write this way (skipped):")
        lines.extend(f"    {m[:200]}" for m in p["malformed"][:10])
    if p["dead_letters"]:
        lines.append(f"  FAILED   {len(p['dead_letters'])} batches in dead letters (hsx retry-failed --run {p['run']}):")
        for bid, rec in sorted(p["dead_letters"].items())[:10]:
            lines.append(f"    {bid}: {rec['attempts']} attempts, last error: {rec['last_error'][:160]}")
    return lines
