"""A real ``hsx produce`` of a large generated dataset, timed from its start to its first job on the queue.

    python bench/producer_e2e.py --rows 1000000 --out DIR        (redis-server on PATH; bench/run_gpu.sh producer)

Rows are bench/producer_bench.py's (thinking + tools chat template, 32k-token BPE tokenizer trained on generated
text, 30 % single-turn, 30 % chat, 40 % agentic): ``--unique`` distinct rows are generated on every core and
repeated under new ids up to ``--rows`` (tokenising a repeat costs what the first did). Then a private
redis-server, a local-directory store, and ``hsx produce`` as its own process with default flags (every core
tokenises, 20k-row windows): the clock runs from spawning the process to the first job on the run's extract
queue (rq's queue length, polled every 20 ms), i.e. Python start-up, the dataset's fingerprint, tokenising
the first window, planning it, writing its inputs and enqueueing. The producer is then stopped. Writes
producer_e2e.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import producer_bench  # noqa: E402

PREFIX = '{"id": "'


def _rows(args: tuple[int, int, int]) -> list[str]:
    seed, start, n = args
    gen = producer_bench.TextGen(seed)
    return [json.dumps(producer_bench.make_row(gen, start + i)) for i in range(n)]


def write_rows(path: Path, rows: int, unique: int, procs: int) -> dict:
    t = time.perf_counter()
    per = -(-unique // procs)
    with multiprocessing.Pool(procs) as pool:
        chunks = pool.map(_rows, [(11 + k, k * per, per) for k in range(procs)])
    lines = [line for chunk in chunks for line in chunk][:unique]
    generated = time.perf_counter() - t
    with open(path, "w") as fh:
        for i in range(rows):
            line = lines[i % len(lines)]
            fh.write(f'{PREFIX}c{i // len(lines)}-{line[len(PREFIX):]}\n')  # a new id, the same row
    return {"rows": rows, "unique": len(lines), "generate_s": round(generated, 1),
            "write_s": round(time.perf_counter() - t - generated, 1), "bytes": path.stat().st_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--unique", type=int, default=64_000)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--work", default="/tmp/hsx-producer-e2e")
    ap.add_argument("--timeout", type=float, default=180)
    ap.add_argument("--out", default=str(ROOT / "bench-out"))
    args = ap.parse_args()
    from hsx.life import queues
    from hsx.redisconn import LocalRedis, connect

    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model = producer_bench.build_tokenizer(work / f"bpe{args.vocab // 1000}k", args.vocab, seed=7)
    result = {"cpu_count": os.cpu_count(), "tokenizer_build_s": round(time.perf_counter() - t, 1)}
    dataset = work / f"rows{args.rows}.jsonl"
    result["dataset"] = write_rows(dataset, args.rows, args.unique, os.cpu_count() or 1)
    print(f"[producer_e2e] {json.dumps(result)}", flush=True)
    server = LocalRedis(work / "redis").start()
    r = connect(server.url)
    run = "e2e"
    log = open(out / "producer_e2e.log", "w")
    env = {**os.environ, "HSX_REDIS_URL": server.url, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "hsx_cli.main", "produce", "--dataset", str(dataset), "--model", str(model),
           "--layers", "dflash:3", "--store", str(work / "store"), "--run", run, "--max-length", "8192"]
    queue = queues.queue(r, queues.extract_queue_name(run))
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        first = None
        while time.perf_counter() - start < args.timeout and proc.poll() is None:
            if queue.count:
                first = time.perf_counter() - start
                break
            time.sleep(0.02)
        jobs_at_first = queue.count
        time.sleep(2.0)  # the rest of the window's jobs
        result.update(first_enqueue_s=round(first, 2) if first is not None else None, jobs_at_first=jobs_at_first,
                      jobs_2s_later=queue.count, exit_code=proc.poll(), command=" ".join(cmd[2:]))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        log.close()
        server.stop()
    (out / "producer_e2e.json").write_text(json.dumps(result, indent=1))
    print(f"[producer_e2e] {args.rows} rows ({result['dataset']['bytes'] / 2**30:.2f} GiB): hsx produce to its "
          f"first enqueue {result['first_enqueue_s']} s on {result['cpu_count']} cores ({result['jobs_at_first']} "
          f"jobs, {result['jobs_2s_later']} 2 s later)", flush=True)
    return 0 if result["first_enqueue_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
