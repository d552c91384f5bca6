"""Scaling across workers: N `hsx worker` processes sharing one Redis, one spool and an uploader pool.

One command, same on a CPU box and a multi-GPU host:

    python bench/multi_worker.py --device cpu --workers 1,2 --uploaders 2          # tiny model, CPU
    python bench/multi_worker.py --device cuda --workers 1,2,4,8 --uploaders 8 \\
        --model /models/qwen3-8b-random --token-budget 32768 --samples 20000       # one worker per GPU

For each N it plans a fresh run, starts N workers (``--gpu i`` for i < N on
CUDA, ``--device cpu`` otherwise) and the uploaders as real processes, and
measures: aggregate useful tokens/s (real tokens over the time from the first
batch spooled to the last batch done), scaling efficiency against N x the
1-worker rate of the same invocation, batches taken per worker (even
spread), upload throughput, spool high-water mark, and that the ledger, the
per-host upload queue and the spool agree at the end. With ``--join-stop`` the
largest N also adds one worker mid-run (time until it takes its first job)
and SIGTERMs one mid-run (nothing lost). Prints a table last; JSON to --out.
On CPU, N workers share the machine's cores, so efficiency there measures the
orchestration, not GPU scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsx.life import heartbeat, ledger, queues  # noqa: E402
from hsx.life.keys import RunKeys  # noqa: E402
from hsx.redisconn import LocalRedis, connect, int_hash  # noqa: E402
from hsx.store import open_store  # noqa: E402
from hsx_tools.verify import verify_run  # noqa: E402

HOST = "bench-host"


def synthetic_rows(path: Path, samples: int, vocab: int, seed: int = 0) -> Path:
    """Pre-tokenised rows with a lognormal length mix (median ~600 tokens, cap 4096) scaled to ``cap``."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(samples):
            n = max(16, min(4096, int(rng.lognormvariate(6.4, 0.6))))
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            fh.write(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)}) + "\n")
    return path


def hsx(*args):
    return [sys.executable, "-m", "hsx_cli.main", *args]


def run_once(n_workers: int, args, work: Path, redis_url: str, model: str, dataset: Path, join_stop: bool) -> dict:
    run = f"scale{n_workers}"
    store_dir, spool_dir, logs = work / f"store-{run}", work / f"spool-{run}", work / "logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, "HSX_REDIS_URL": redis_url, "HSX_HOST": HOST, "PYTHONUNBUFFERED": "1"}
    subprocess.run(hsx("produce", "--run", run, "--dataset", str(dataset), "--model", model, "--layers", args.layers,
                       "--store", str(store_dir), "--token-budget", str(args.token_budget), "--dtype", args.dtype,
                       "--max-length", "4096", "--overlong", "truncate"), env=env, check=True,
                   stdout=subprocess.DEVNULL)
    r = connect(redis_url)
    totals = ledger.run_totals(r, run)

    def worker(i):
        dev = ["--gpu", str(0 if args.same_gpu else i)] if args.device == "cuda" else ["--device", "cpu"]
        log = open(logs / f"{run}-w{i}.log", "w")
        return subprocess.Popen(hsx("worker", "--run", run, *dev, "--spool-dir", str(spool_dir), "--host", HOST,
                                    "--heartbeat-seconds", "1", "--name", f"{run}-w{i}"), env=env,
                                stdout=log, stderr=subprocess.STDOUT)

    uploaders = [subprocess.Popen(hsx("upload", "--spool-dir", str(spool_dir), "--host", HOST, "--heartbeat-seconds", "1"),
                                  env=env, stdout=open(logs / f"{run}-u{j}.log", "w"), stderr=subprocess.STDOUT)
                 for j in range(args.uploaders)]
    first = n_workers - 1 if join_stop and n_workers > 1 else n_workers
    workers = [worker(i) for i in range(first)]
    keys = RunKeys(run)
    spool_high = 0
    joined_after = stopped = None
    t0 = time.monotonic()
    try:
        while ledger.done_count(r, run) < totals["batches"]:
            for stats in heartbeat.read_hosts(r, run).values():
                spool_high = max(spool_high, stats.get("spool_bytes", 0))
            spooled = int(r.zcard(keys.spooled_log))
            if join_stop and len(workers) < n_workers and spooled >= totals["batches"] // 4:
                workers.append(worker(n_workers - 1))
                t_join = time.monotonic()
            if join_stop and len(workers) == n_workers and joined_after is None:
                busy = [w for w in heartbeat.read_workers(r, run) if w.get("pid") == workers[-1].pid and w.get("batches")]
                if busy:
                    joined_after = time.monotonic() - t_join
            if join_stop and joined_after is not None and stopped is None and spooled >= totals["batches"] * 2 // 3:
                workers[0].send_signal(signal.SIGTERM)
                stopped = workers[0].pid
            if time.monotonic() - t0 > args.timeout:
                raise TimeoutError(f"run {run} did not finish in {args.timeout}s")
            time.sleep(0.25)
    finally:
        for p in workers + uploaders:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in workers + uploaders:
            p.wait(timeout=120)
    per_worker = {}
    for i in range(len(workers)):
        text = (logs / f"{run}-w{i}.log").read_text()
        m = re.search(r": (\d+) batches, (\d+) tokens", text)
        per_worker[f"w{i}"] = int(m.group(1)) if m else 0
    spooled_ts = [s for _, s in r.zrange(keys.spooled_log, 0, -1, withscores=True)]
    done_ts = [s for _, s in r.zrange(keys.done_log, 0, -1, withscores=True)]
    span = max(done_ts) - min(spooled_ts)
    done = int_hash(r, keys.counters)
    report = verify_run(r, open_store(str(store_dir)), run, quick=True)
    leftover = [p for p in spool_dir.rglob("*") if p.is_file()]
    return {
        "workers": n_workers, "uploaders": args.uploaders, "batches": totals["batches"], "tokens": totals["tokens"],
        "tokens_per_s": totals["tokens"] / span, "span_s": span, "per_worker_batches": per_worker,
        "upload_MB_per_s": done["bytes"] / 1e6 / span, "spool_high_water_bytes": spool_high,
        "joined_worker_first_job_s": joined_after, "stopped_worker_pid": stopped,
        "ledger_ok": report.ok and done["batches"] == totals["batches"] and done["tokens"] == totals["tokens"],
        "upload_queue_left": len(queues.queue(r, queues.upload_queue_name(HOST))), "spool_files_left": len(leftover),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--workers", default="1,2", help="comma-separated N to measure (the first should be 1)")
    ap.add_argument("--uploaders", type=int, default=2)
    ap.add_argument("--model", help="model directory (default: build the tiny Qwen3)")
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--layers", default="dflash:3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--same-gpu", action="store_true", help="all workers on GPU 0 (a functional check on a 1-GPU box)")
    ap.add_argument("--join-stop", action="store_true", help="at the largest N: add a worker mid-run, SIGTERM one")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, help="write the JSON results here")
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    with tempfile.TemporaryDirectory(prefix="hsx-scale-") as tmp:
        work = Path(tmp)
        from transformers import AutoTokenizer

        from hsx_tools.demo import sample_dataset
        from hsx_tools.tinymodel import build_tiny_model

        model = args.model or str(build_tiny_model(work / "tiny", sample_path=sample_dataset()))
        dataset = synthetic_rows(work / "rows.jsonl", args.samples, len(AutoTokenizer.from_pretrained(model)))
        with LocalRedis(work / "redis") as server:
            results = [run_once(n, args, work, server.url, model, dataset, args.join_stop and n == max(counts))
                       for n in counts]
    base = next((x["tokens_per_s"] for x in results if x["workers"] == 1), None)
    for x in results:
        x["efficiency"] = x["tokens_per_s"] / (x["workers"] * base) if base else None
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(f"\n{'N':>2} {'tokens/s':>10} {'eff':>5} {'upload MB/s':>11} {'spool hw MB':>11} {'per-worker batches':<28} "
          f"{'join s':>6} {'ledger/spool/queue':<18}")
    for x in results:
        eff = f"{x['efficiency']:.2f}" if x["efficiency"] else "-"
        join = f"{x['joined_worker_first_job_s']:.1f}" if x["joined_worker_first_job_s"] is not None else "-"
        state = f"{'ok' if x['ledger_ok'] else 'BAD'}/{x['spool_files_left']}/{x['upload_queue_left']}"
        print(f"{x['workers']:>2} {x['tokens_per_s']:>10.0f} {eff:>5} {x['upload_MB_per_s']:>11.1f} "
              f"{x['spool_high_water_bytes'] / 1e6:>11.1f} {json.dumps(x['per_worker_batches']):<28} {join:>6} {state:<18}")
    return 0 if all(x["ledger_ok"] and not x["spool_files_left"] and not x["upload_queue_left"] for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())
