"""The embedded default: the whole pipeline on one machine, as real processes, started as `hsx run` starts
them (hsx_tools/launch.py).

private redis-server (if none reachable) -> tiny Qwen3 + tokenizer built here
-> `hsx produce` on the shipped sample, one CPU `hsx worker` and two
`hsx upload` (their logs in WORKDIR/logs/demo) -> a local-directory store, verified. Prints where the output is and the next
commands: read a sample (`hsx show`), look at the run (`hsx demo --look`, or
`hsx status` / `hsx dashboard` where the demo used a Redis of yours), train.

The private redis-server stops with the demo, but its data stays in WORKDIR/redis
(AOF) and its port in WORKDIR/redis/port: `hsx demo --look` starts it again on that
port with the run's ledger, prints `hsx status` and serves the dashboard until
stopped (Ctrl-C), then stops the Redis it started.
"""

from __future__ import annotations

import os
import subprocess
import time
from importlib import resources
from pathlib import Path

from hsx.redisconn import reachable, redact
from hsx_tools.launch import Launch, Signals, Stopped, launch
from hsx_tools.processes import hsx_argv
from hsx_tools.statedir import StateLock, private_redis

RUN = "demo"


def sample_dataset() -> Path:
    return Path(str(resources.files("hsx_tools") / "data" / "sample_conversations.jsonl"))


def demo_launch(dataset: Path, model: Path, store: Path, workdir: Path) -> Launch:
    """The demo's run as `hsx run` would start it: one CPU worker and two uploaders of host "demo"."""
    roles = ("--spool-dir", str(workdir / "spool"), "--host", "demo")
    return Launch(
        run=RUN,
        produce=("--run", RUN, "--dataset", str(dataset), "--model", str(model), "--layers", "dflash:3",
                 "--store", str(store), "--token-budget", "2048", "--max-length", "2048", "--dtype", "float32"),
        workers=(("worker-cpu", ("--run", RUN, "--device", "cpu", "--wait-for-plan", "--exit-when-complete", *roles)),),
        upload=roles, uploaders=2, logs=workdir / "logs" / RUN, verify="full", same_plan={"dataset": str(dataset.resolve())})


def run_demo(store: Path, workdir: Path, samples: int | None = None) -> int:
    from hsx.monitor import fmt_bytes, run_progress
    from hsx.redisconn import connect
    from hsx_tools.tinymodel import build_tiny_model

    started = time.monotonic()
    store, workdir = store.resolve(), workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    local = None
    url = env.get("HSX_REDIS_URL") or env.get("REDIS_URL")
    with Signals() as signals, StateLock(workdir):
        try:
            if not url or not reachable(url):
                local = private_redis(workdir)
                url = local.url
                print(f"started a private redis-server at {url} (data in {workdir / 'redis'})", flush=True)
            env["HSX_REDIS_URL"] = url
            dataset = sample_dataset()
            if samples:
                dataset = workdir / f"sample-{samples}.jsonl"
                dataset.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:samples]))
            model = build_tiny_model(workdir / "tiny-qwen3", sample_path=sample_dataset())
            rc = launch(demo_launch(dataset, model, store, workdir), url, env, signals)
            p = run_progress(connect(url), RUN) if rc == 0 else None
        except Stopped as stop:
            return 128 + stop.signum
        finally:
            if local:
                signals.stopping = True
                local.stop()
    if p is None:
        return rc
    d = p["done"]
    print(f"\noutput: {store / RUN}  (manifest.json, index.jsonl, batches/)")
    print(f"done: {d['batches']}/{p['totals']['batches']} batches, {d['samples']} samples, {d['tokens']} tokens, "
          f"{fmt_bytes(d['bytes'])} verified in {time.monotonic() - started:.1f}s; "
          f"{len(p['dead_letters'])} failed batches")
    print("\n".join(next_steps(store, workdir, model, None if local else url)))
    return 0


def next_steps(store: Path, workdir: Path, model: Path, redis_url: str | None) -> list[str]:
    """What to do with the demo's run: read a sample, look at the run, train on it."""
    look = (f"hsx status --run {RUN}   # or hsx dashboard: the run stays in your Redis ({redact(redis_url)})" if redis_url else
            f"hsx demo --workdir {workdir} --look   # the demo's Redis again, its status, and the dashboard")
    return [
        "next:",
        f"  read a sample:   hsx show {RUN} '#0' --store {store}          # no Redis needed",
        f"  look at the run: {look}",
        f"  train (CPU):     hsx export --run {RUN} --for specforge-dflash --out {workdir / 'export'} --store {store}",
        "                   then SpecForge on a CPU, 40 steps in about 30 s: docs/training.md, \"SpecForge on the demo\"",
        f"                   (the target is {model})",
    ]


def look(workdir: Path, serve=None) -> int:
    """Start the demo's private Redis again from WORKDIR/redis, print `hsx status`, serve the dashboard until
    stopped (``serve(env)``: what runs while the Redis is up; default `hsx dashboard` in the foreground)."""
    workdir = workdir.resolve()
    if not (workdir / "redis" / "port").exists():
        from hsx.errors import ConfigError

        raise ConfigError(f"no demo Redis in {workdir / 'redis'}: run `hsx demo --workdir {workdir}` first "
                          "(a demo that used your own Redis left its run there: hsx status --run demo)")
    with StateLock(workdir):
        local = private_redis(workdir)
        env = dict(os.environ, HSX_REDIS_URL=local.url)
        try:
            print(f"the demo's Redis is up again at {local.url} (data in {workdir / 'redis'}); in another shell:\n"
                  f"  HSX_REDIS_URL={local.url} hsx status --run {RUN}", flush=True)
            subprocess.run(hsx_argv("status", "--run", RUN), env=env, check=False)
            if serve is not None:
                return serve(env)
            try:
                return subprocess.run(hsx_argv("dashboard"), env=env, check=False).returncode
            except KeyboardInterrupt:
                return 0
        finally:
            local.stop()
