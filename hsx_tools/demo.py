"""The embedded default: the whole pipeline on one machine, as real processes.

private redis-server (if none reachable) -> tiny Qwen3 + tokenizer built here
-> `hsx produce` on the shipped sample -> one CPU `hsx worker` + two
`hsx upload` -> a local-directory store. Prints where the output is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

from hsx.redisconn import LocalRedis, reachable
from hsx_tools.processes import stop_all

RUN = "demo"


def sample_dataset() -> Path:
    return Path(str(resources.files("hsx_tools") / "data" / "sample_conversations.jsonl"))


def _hsx(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsx_cli.main", *args]


def run_demo(store: Path, workdir: Path, samples: int | None = None) -> int:
    from hsx.redisconn import connect
    from hsx.run.progress import fmt_bytes, run_progress
    from hsx_tools.tinymodel import build_tiny_model

    started = time.monotonic()
    store, workdir = store.resolve(), workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    local = None
    url = env.get("HSX_REDIS_URL") or env.get("REDIS_URL")
    if not url or not reachable(url):
        local = LocalRedis(workdir / "redis").start()
        url = local.url
        print(f"started a private redis-server at {url} (data in {workdir / 'redis'})")
    env["HSX_REDIS_URL"] = url
    dataset = sample_dataset()
    if samples:
        dataset = workdir / f"sample-{samples}.jsonl"
        dataset.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:samples]))
    model = build_tiny_model(workdir / "tiny-qwen3", sample_path=sample_dataset())
    spool = workdir / "spool"
    procs: list[subprocess.Popen] = []
    try:
        subprocess.run(_hsx("produce", "--run", RUN, "--dataset", str(dataset), "--model", str(model),
                            "--layers", "dflash:3", "--store", str(store), "--token-budget", "2048",
                            "--max-length", "2048",
                            "--dtype", "float32"), env=env, check=True)
        procs.append(subprocess.Popen(_hsx("worker", "--run", RUN, "--device", "cpu", "--spool-dir", str(spool),
                                           "--host", "demo", "--burst"), env=env))
        for _ in range(2):
            procs.append(subprocess.Popen(_hsx("upload", "--spool-dir", str(spool), "--host", "demo"), env=env))
        r = connect(url)
        while True:
            p = run_progress(r, RUN)
            if p["complete"] and p["index_written"]:
                break
            if procs[0].poll() not in (None, 0):
                print("the worker failed; see its log above", file=sys.stderr)
                return 1
            if procs[0].poll() == 0 and p["extract_queue"] == 0 and not p["workers"] and p["dead_letters"]:
                break
            time.sleep(0.5)
    except subprocess.CalledProcessError as exc:
        print(f"hsx demo: a step failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(procs)
        if local:
            local.stop()
    d = p["done"]
    print(f"\noutput: {store / RUN}  (manifest.json, index.jsonl, batches/)")
    print(f"done: {d['batches']}/{p['totals']['batches']} batches, {d['samples']} samples, {d['tokens']} tokens, "
          f"{fmt_bytes(d['bytes'])} verified in {time.monotonic() - started:.1f}s; "
          f"{len(p['dead_letters'])} failed batches")
    return 0 if p["complete"] else 1
