"""Redis memory a run holds per million samples, stage by stage, and how fast the ledger's readers are at that size.

    PYTHONPATH=. .venv/bin/python bench/redis_scale.py [--samples 100000] [--json out.json]

A private redis-server (AOF on, noeviction, as tests/conftest.py starts one). N synthetic pre-tokenised samples
(lengths 90-130 tokens, mean ~110; the row index is the sample id) are planned window by window with the producer's
own code (``cut_batches`` under a 4,096-token budget: ~37 samples a batch, as the held-out check of issue 42;
``BatchSpec``s as ``producer.produce._plan_window`` builds them; ``Run.save_plan``; the producer's ``_enqueue``
under its lock; the window record), then driven through the real life verbs by real rq workers (``perform_job`` of
an rq SimpleWorker per job: rq's own registries and result TTLs) whose job functions are fakes: the extractor
leases, spools (no file) and hands the batch on; the uploader writes a 16-byte object to a local store and
finishes it (with its host, as hsx's uploader does: the host's upload counts). No input objects are written (the
plan's input SHA-256 is a stand-in).

Stages, each reported as used_memory (INFO memory, less the empty server's) per million samples, and per key kind
(MEMORY USAGE, summed over the keys of that kind):

- planned:   the whole plan saved, nothing enqueued (``hsx produce --no-enqueue``);
- queued:    every window enqueued, as ``hsx produce`` leaves a run;
- leased:    half the batches extracted and spooled (their upload jobs queued), one leased;
- done:      every batch extracted, uploaded and recorded done;
- completed: the reconciler and the reaper passed, the index written; rq's finished jobs still within their TTL.

Timings at the "leased" stage (a run mid-way): ``hsx status`` (``run_progress`` + ``summary_lines``), /api/status
(the dashboard through Flask's test client, first and second call), the producer's ``resume`` after a kill, one
reconcile pass and one reaper pass; for each pass the Redis commands it issued (INFO commandstats) and the
longest single command (SLOWLOG): what a worker waits behind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

from rq import SimpleWorker
from rq.serializers import JSONSerializer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsx import life  # noqa: E402
from hsx.life import batchlife, queues, reconcile  # noqa: E402
from hsx.prep import TokeniseReport, cut_batches  # noqa: E402
from hsx.redisconn import LocalRedis, connect, text  # noqa: E402
from hsx.store import layout  # noqa: E402
from hsx.store.local import LocalStore  # noqa: E402
from producer import windows  # noqa: E402
from producer.produce import _enqueue  # noqa: E402
from tests.manifests import example_manifest  # noqa: E402

RUN = "scale"
HOST = "benchhost"
BUDGET, MAX_ROWS, PAD = 4096, 64, 8
WINDOW_ROWS = 20000
LEASE_SECONDS = 600
O_RUN = {"hkeys", "hvals", "hgetall", "smembers", "sinter", "sdiff", "sunion", "keys", "lrange", "zrange",
         "zrangebyscore", "zrevrange", "lrem", "hscan", "sscan"}   # commands whose cost grows with the key
RUN_SIZED = {"plan", "done", "done_info", "done_seq", "done_seq_pos", "done_log", "spooled_log"}  # keys O(run)


class Bench:
    """The state the fake job functions reach (rq resolves functions by name, so they live at module level)."""

    store = None
    run = None   # the run's handle (life.Run)


def fake_extract(run: str, batch_id: str, attempt: int | None = None) -> str:
    ledger = Bench.run
    spec = ledger.lease(batch_id, LEASE_SECONDS)
    if ledger.release_if_done(batch_id):
        return "done already"
    pipe = ledger.r.pipeline()
    ledger.spool(batch_id, HOST, f"/spool/{run}/{batch_id}.safetensors", 16, hashlib.sha256(b"x").hexdigest(), "disk",
                 pipe)
    pipe.execute()
    return spec.batch_id


def fake_upload(run: str, batch_id: str, path: str, size: int, sha256: str, retry: int = 0, tier: str = "disk",
                **_ignored) -> str:
    ledger, store = Bench.run, Bench.store
    job = life.UploadJob(HOST, path, size, sha256, tier)
    with ledger.uploading(batch_id, job, LEASE_SECONDS):
        if ledger.is_done(batch_id):
            return "done already"
        spec = ledger.spec(batch_id)
        key = layout.batch_key(run, spec.shard, batch_id)
        info = store.put_bytes(key, b"x" * 16)
        ledger.finish(spec, key, info.size, sha256, by="bench-uploader", host=HOST)
    ledger.write_index_if_complete(store)
    return batch_id


class BenchJob(queues.HsxJob):
    """An hsx job whose functions are the fakes above (the job hashes are the real ones)."""

    @property
    def func(self):
        return {queues.EXTRACT_FUNC: fake_extract, queues.UPLOAD_FUNC: fake_upload}[self.func_name]


def key_kind(key: str) -> str:
    """A key's kind: ``hsx:<run>:plan`` -> ``plan``, ``rq:job:<id>`` -> ``rq:job``, ``rq:queue:upload@h`` ->
    ``rq:queue:upload``."""
    if key.startswith(f"hsx:{RUN}:"):
        rest = key[len(f"hsx:{RUN}:"):]
        return rest.split(":")[0] if ":" in rest else rest
    parts = key.split(":")
    if parts[0] == "rq" and len(parts) >= 2:
        return "rq:" + parts[1] + (":" + parts[2].split("@")[0].split(":")[0] if len(parts) > 2 and parts[1] in (
            "queue", "wip", "finished", "failed", "started", "deferred", "scheduled", "canceled", "intermediate") else "")
    return parts[0]


def memory(r, base: int, samples: int) -> dict:
    """used_memory over the empty server's, per million samples, and MEMORY USAGE by key kind (bytes)."""
    used = int(r.info("memory")["used_memory"]) - base
    kinds: Counter = Counter()
    counts: Counter = Counter()
    batch = []
    for key in r.scan_iter(count=5000):
        batch.append(text(key))
        if len(batch) == 2000:
            _usage(r, batch, kinds, counts)
            batch = []
    _usage(r, batch, kinds, counts)
    keys_bytes = sum(kinds.values())
    return {"used_bytes": used, "mib_per_m": used / 2**20 / (samples / 1e6), "keys_bytes": keys_bytes,
            "keys_mib_per_m": keys_bytes / 2**20 / (samples / 1e6), "by_kind": dict(kinds.most_common()),
            "keys_by_kind": dict(counts)}


def _usage(r, keys: list[str], kinds: Counter, counts: Counter) -> None:
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    for key, size in zip(keys, pipe.execute(), strict=True):
        kinds[key_kind(key)] += int(size or 0)
        counts[key_kind(key)] += 1


def plan(run: life.Run, store, samples: int, enqueue: bool, seed: int) -> list[int]:
    """Plan the run window by window as the producer does; the batch count of each window."""
    manifest = example_manifest(RUN, store=str(store.root), token_budget=BUDGET, max_length=512,
                                max_batch_rows=MAX_ROWS, pad_multiple=PAD, window_rows=WINDOW_ROWS)
    rng = random.Random(seed)
    cfg = SimpleNamespace(run=RUN, enqueue=enqueue)
    totals = {"batches": 0, "samples": 0, "tokens": 0, "padded_tokens": 0}
    per_window = []
    run.start_feeding()
    with run.producer_lock(5.0) as lock:
        planning = SimpleNamespace(run=run, cfg=cfg, lock=lock, done=set(), pending=set())
        for number, start in enumerate(range(0, samples, WINDOW_ROWS)):
            lengths = [rng.randint(90, 130) for _ in range(min(WINDOW_ROWS, samples - start))]
            planned = cut_batches(lengths, BUDGET, MAX_ROWS, PAD)
            first = totals["batches"]
            specs = []
            for offset, batch in enumerate(planned):
                index = first + offset
                bid = layout.batch_id(index)
                specs.append(life.BatchSpec(
                    batch_id=bid, index=index, shard=layout.shard_of(index, manifest.batches_per_shard),
                    samples=len(batch.members), tokens=batch.tokens, padded=batch.padded,
                    padded_len=batch.padded_len, sample_ids=[str(start + i) for i in batch.members],
                    input_sha256=hashlib.sha256(bid.encode()).hexdigest()))
            run.write_window_ids(store, number, specs)   # the ids in the store, their digest in the plan
            specs = [spec.for_plan() for spec in specs]
            run.save_plan(manifest, specs, {"planning": 1})
            enqueued = _enqueue(planning, specs, first + len(specs))
            rec = windows.WindowRecord(first_batch=first, batches=len(specs), samples=len(lengths),
                                       tokens=sum(s.tokens for s in specs), padded_tokens=sum(s.padded for s in specs),
                                       padding=0.0, enqueued=enqueued, report=TokeniseReport(rows=len(lengths)))
            windows.record(run, number, rec)
            for k, v in (("batches", len(specs)), ("samples", len(lengths)), ("tokens", rec.tokens),
                         ("padded_tokens", rec.padded_tokens)):
                totals[k] += v
            run.save_plan(manifest, [], {**totals, "planning": 1, "rows": totals["samples"]})
            per_window.append(len(specs))
        run.save_plan(manifest, [], {**totals, "planning": 0, "rows": totals["samples"]})
    return per_window


def drive(r, queue_name: str, jobs: int | None) -> int:
    """Run up to ``jobs`` jobs of ``queue_name`` through rq's own per-job path (None: until it is empty)."""
    q = queues.queue(r, queue_name)
    q.job_class = BenchJob
    worker = SimpleWorker([q], connection=r, serializer=JSONSerializer, job_class=BenchJob,
                          name=f"bench-{queue_name.replace(':', '-')}-{time.monotonic_ns()}")
    worker.register_birth()
    done = 0
    while jobs is None or done < jobs:
        found = q.dequeue_any([q], None, connection=r, job_class=BenchJob, serializer=JSONSerializer)
        if found is None:
            break
        worker.execute_job(*found)   # rq's per-job path: started registry, the function, result and TTLs
        done += 1
    worker.register_death()
    return done


def timed(fn, *args, repeat: int = 1, **kwargs):
    best, out = None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
    return best, out


def commands_of(r, fn, *args) -> tuple[float, dict, int, list[str], object]:
    """(seconds, {command: calls}, longest single command in microseconds, the whole-key reads of keys that grow
    with the run ("HKEYS hsx:<run>:plan"), result) of ``fn(*args)``."""
    before = {k: v["calls"] for k, v in r.info("commandstats").items()}
    r.config_set("slowlog-log-slower-than", 0)
    r.config_set("slowlog-max-len", 100000)
    r.slowlog_reset()
    t0 = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - t0
    slow = r.slowlog_get(100000)
    r.config_set("slowlog-log-slower-than", 10000)   # the defaults again, and the log emptied: its entries are memory
    r.config_set("slowlog-max-len", 128)
    r.slowlog_reset()
    after = {k: v["calls"] for k, v in r.info("commandstats").items()}
    calls = {k.removeprefix("cmdstat_"): after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    calls.pop("slowlog|reset", None)
    calls.pop("config|set", None)
    calls.pop("info", None)
    longest = max((int(e["duration"]) for e in slow if b"slowlog" not in e["command"].lower()
                   and b"config" not in e["command"].lower()), default=0)
    o_run = sorted({" ".join(words[:2]) for e in slow for words in [text(e["command"]).split()]
                    if len(words) > 1 and words[0].lower() in O_RUN and key_kind(words[1]) in RUN_SIZED})
    return took, calls, longest, o_run, out


def readers(r, store, server_url: str) -> dict:
    """The timings at a run mid-way (see the module's docstring)."""
    from dashboard.app import create_app
    from dashboard.config import DashboardConfig
    from hsx.monitor import run_progress, summary_lines
    from producer.planning import Planning
    from producer.produce import resume

    out = {}
    out["hsx_status_s"], _ = timed(lambda: summary_lines(run_progress(r, RUN)), repeat=2)
    client = create_app(DashboardConfig(redis_url=server_url), r=r).test_client()
    t0 = time.perf_counter()
    first = client.get(f"/api/status?run={RUN}")
    out["api_status_first_s"] = time.perf_counter() - t0
    assert first.status_code == 200, first.data[:300]
    out["api_status_s"], _ = timed(lambda: client.get(f"/api/status?run={RUN}"), repeat=2)
    t0 = time.perf_counter()
    page = client.get(f"/?run={RUN}")
    out["dashboard_page_s"] = time.perf_counter() - t0
    assert page.status_code == 200
    cfg = SimpleNamespace(run=RUN, enqueue=True, lock_wait_seconds=5.0)
    with Bench.run.producer_lock(5.0) as lock:
        planning = Planning(r, store, cfg, lock)
        out["resume_s"], planning = timed(resume, planning, True)
        out["resume_reenqueued"] = planning.enqueued
    r.delete(life.RunKeys(RUN).orphans)
    reconcile.reconcile(r, RUN, grace=0)   # first pass: notes orphans (none expected)
    took, calls, longest, o_run, due = commands_of(r, reconcile.reconcile, r, RUN, 0)
    out["reconcile"] = {"s": took, "calls": calls, "longest_us": longest, "requeued": len(due), "o_run": o_run}
    took, calls, longest, o_run, got = commands_of(r, batchlife.reap, r, RUN, 3)
    out["reap"] = {"s": took, "calls": calls, "longest_us": longest, "reclaimed": sum(map(len, got.values())),
                   "o_run": o_run}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    ap.add_argument("--no-readers", action="store_true", help="skip the reader timings")
    args = ap.parse_args(argv)
    n = args.samples
    report: dict = {"samples": n, "stages": {}, "seconds": {}}
    scratch = "/dev/shm" if Path("/dev/shm").is_dir() else None   # the store's fsyncs are not what is measured
    with tempfile.TemporaryDirectory(dir=scratch) as tmp, LocalRedis(Path(tmp) / "redis") as server:
        r = connect(server.url)
        Bench.store, Bench.run = LocalStore(Path(tmp) / "store"), life.Run(r, RUN)
        base = int(r.info("memory")["used_memory"])
        t0 = time.perf_counter()
        per_window = plan(Bench.run, Bench.store, n, enqueue=False, seed=args.seed)
        report["seconds"]["plan"] = time.perf_counter() - t0
        batches = sum(per_window)
        report["batches"] = batches
        report["stages"]["planned"] = memory(r, base, n)
        # The producer run again without --no-enqueue: it resumes every window and enqueues them.
        t0 = time.perf_counter()
        r.flushall()
        base = int(r.info("memory")["used_memory"])
        plan(Bench.run, Bench.store, n, enqueue=True, seed=args.seed)
        report["seconds"]["plan_and_enqueue"] = time.perf_counter() - t0
        report["stages"]["queued"] = memory(r, base, n)
        Bench.run.publish_host(HOST, {"spool_bytes": 0, "spool_files": 0, "spool_budget_bytes": None})
        t0 = time.perf_counter()
        half = batches // 2
        drive(r, queues.extract_queue_name(RUN), half)
        drive(r, queues.upload_queue_name(HOST), None)
        drive(r, queues.extract_queue_name(RUN), 1)   # ... and one extracted, spooled: its upload queued
        Bench.run.lease(layout.batch_id(half + 1), LEASE_SECONDS)  # one batch leased by a worker at work
        report["seconds"]["drive_half"] = time.perf_counter() - t0
        report["stages"]["leased"] = memory(r, base, n)
        if not args.no_readers:
            report["readers"] = readers(r, Bench.store, server.url)
        t0 = time.perf_counter()
        r.zrem(life.RunKeys(RUN).extract_leases, layout.batch_id(half + 1))
        drive(r, queues.extract_queue_name(RUN), None)
        drive(r, queues.upload_queue_name(HOST), None)
        report["seconds"]["drive_rest"] = time.perf_counter() - t0
        out = Bench.run.outstanding()
        assert out.complete, f"not every batch is done: {out}"
        report["stages"]["done"] = memory(r, base, n)
        reconcile.reconcile(r, RUN, grace=0)
        batchlife.reap(r, RUN, 3)
        assert Bench.run.write_index_if_complete(Bench.store)
        report["stages"]["completed"] = memory(r, base, n)
        # What the server kept that is in no key (client and AOF buffers, grown while rq drove the jobs): every key
        # deleted, used_memory over the empty server's. A fixed cost, not one per sample (~0.9 MB at 30k-200k).
        left = list(r.scan_iter(count=5000))
        for start in range(0, len(left), 5000):
            r.delete(*left[start:start + 5000])
        r.script_flush()
        report["server_fixed_bytes"] = int(r.info("memory")["used_memory"]) - base
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


def print_report(report: dict) -> None:
    n = report["samples"]
    print(f"{n:,} samples, {report['batches']:,} batches ({n / report['batches']:.1f} samples a batch)")
    print("| stage | MiB per million samples (used_memory) | of it in the run's keys | bytes per batch | biggest kinds "
          "(MiB/M) |")
    print("|---|---|---|---|---|")
    for stage, m in report["stages"].items():
        kinds = defaultdict(int, m["by_kind"])
        top = ", ".join(f"{k} {v / 2**20 / (n / 1e6):.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:6])
        print(f"| {stage} | {m['mib_per_m']:.1f} | {m['keys_mib_per_m']:.1f} | {m['used_bytes'] / report['batches']:.0f} "
              f"| {top} |")
    if "server_fixed_bytes" in report:
        print(f"in no key at the end (every key deleted): {report['server_fixed_bytes'] / 2**20:.2f} MiB, a fixed cost "
              f"({report['server_fixed_bytes'] / 2**20 / (n / 1e6):.1f} MiB per million samples at this size)")
    print("Where the bytes go: MEMORY USAGE of each key kind, bytes per batch (keys of that kind), by stage; "
          "'(rest)' is used_memory less the keys' sum (hash tables, allocator rounding MEMORY USAGE does not count)")
    stages = list(report["stages"])
    kinds = sorted({k for m in report["stages"].values() for k in m["by_kind"]},
                   key=lambda k: -max(m["by_kind"].get(k, 0) for m in report["stages"].values()))
    print("| kind | " + " | ".join(stages) + " |")
    print("|---|" + "---|" * len(stages))
    for kind in kinds:
        cells = []
        for stage in stages:
            m = report["stages"][stage]
            size = m["by_kind"].get(kind, 0)
            cells.append(f"{size / report['batches']:.0f} ({m['keys_by_kind'].get(kind, 0)})" if size else "-")
        if any(c != "-" and not c.startswith("0 ") for c in cells):
            print(f"| {kind} | " + " | ".join(cells) + " |")
    rest = [(m["used_bytes"] - sum(m["by_kind"].values())) / report["batches"] for m in report["stages"].values()]
    print("| (rest) | " + " | ".join(f"{x:.0f}" for x in rest) + " |")
    if "readers" in report:
        rd = report["readers"]
        print(f"hsx status {rd['hsx_status_s']:.3f} s; /api/status first {rd['api_status_first_s']:.3f} s, then "
              f"{rd['api_status_s']:.3f} s; dashboard page {rd['dashboard_page_s']:.3f} s; producer resume "
              f"{rd['resume_s']:.3f} s ({rd['resume_reenqueued']} jobs queued)")
        for name in ("reconcile", "reap"):
            p = rd[name]
            print(f"{name} pass {p['s'] * 1000:.1f} ms, longest command {p['longest_us']} us, "
                  f"whole reads of O(run) keys: {p['o_run'] or 'none'}; calls {p['calls']}")
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report["seconds"].items()))


if __name__ == "__main__":
    main()
