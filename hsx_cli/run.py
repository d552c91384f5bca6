"""`hsx run`: a whole run on this host in one command (hsx_tools/launch.py), with every flag of produce, worker
and upload that applies, passed on to those commands as flags (never a secret: Redis goes in the environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from hsx import defaults as D
from hsx.errors import ConfigError
from hsx_cli import produce, upload, worker
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, redis_url, store_settings
from hsx_cli.flags import Flag

# Flags of the roles that `hsx run` sets itself, or that mean one process, not a host's set of them.
NOT_PASSED = frozenset({"--redis-url", "--no-enqueue", "--gpu", "--device", "--name", "--burst", "--wait-for-plan",
                        "--exit-when-complete"})
WORKER_NOT_PASSED = NOT_PASSED | {"--model"}   # the worker's --model overrides the manifest's; produce's names it
SPOOL_DIR = next(f for f in worker.FLAGS if f.name == "--spool-dir")
FP8_UPLOADERS, GPU_UPLOADERS, CPU_UPLOADERS = 2, 4, 2   # docs/deploy.md, "Scaling uploaders"

OWN_FLAGS = (
    Flag("--gpus", "one worker a GPU: all (every visible CUDA device), a list like 0,1,3, or cpu (one CPU worker)",
         default="all"),
    Flag("--uploaders-per-gpu", f"uploaders a worker (default {GPU_UPLOADERS} a GPU, {FP8_UPLOADERS} with "
         f"--store-dtype float8_e4m3, {CPU_UPLOADERS} with --gpus cpu)", type=int, min=1, max=64),
    Flag("--state-dir", "what outlives one call: the private Redis's data (when no HSX_REDIS_URL), the spool (unless "
         "--spool-dir), the children's logs (default: STORE/.hsx-state for a local store, else "
         "~/.local/share/hsx/state/<store>)"),
    Flag("--verify", "the check that ends a complete run: quick (every object's size, every sample id once) or full "
         "(every object read back: its SHA-256, header and values)", choices=("quick", "full"), default="quick"),
    Flag("--retry-failed", "put the run's dead letters back on the queue before starting", type=bool),
    replace(SPOOL_DIR, default=None, help=SPOOL_DIR.help + " (default: STATE/spool)"),
)


def _flags() -> tuple[Flag, ...]:
    """Own flags, then produce's, worker's and upload's, each name once, less those `hsx run` sets itself."""
    out, seen = [], set()
    roles = (*produce.FLAGS, *(f for f in worker.FLAGS if f.name not in WORKER_NOT_PASSED), *upload.FLAGS)
    for flag in (*OWN_FLAGS, *roles):
        if flag.name not in seen and (flag.name not in NOT_PASSED or flag is REDIS_URL):
            seen.add(flag.name)
            out.append(flag)
    return tuple(out)


FLAGS = _flags()
# The variables of the flags `hsx run` sets itself: not passed to its children (HSX_BURST=1 or HSX_DEVICE in this
# shell would otherwise make an uploader exit when idle, or a worker refuse --gpu).
NOT_INHERITED = tuple(sorted({name for flags, skip in ((produce.FLAGS, NOT_PASSED), (worker.FLAGS, WORKER_NOT_PASSED),
                                                       (upload.FLAGS, NOT_PASSED))
                              for flag in flags if flag.name in skip and flag is not REDIS_URL
                              for name in (flag.env_name, *flag.aliases)}))


@dataclass(frozen=True)
class RunConfig:
    launch: object          # hsx_tools.launch.Launch
    state_dir: Path
    redis_url: str | None   # with HSX_REDIS_PASSWORD added; None: a private redis-server in STATE/redis
    child_redis_url: str | None   # as given: each child adds HSX_REDIS_PASSWORD from the environment itself


def passed(flags, values, skip, **override) -> list[str]:
    """``flags``' values as a command line, those named in ``skip`` left out, ``override`` by dest first."""
    argv: list[str] = []
    for flag in flags:
        if flag.name in skip:
            continue
        value = override.get(flag.dest, values[flag.dest])
        if value is None or value is False or value == []:
            continue
        if flag.type is bool:
            argv.append(flag.name)
        elif isinstance(value, list):   # a repeated flag (--dataset a --dataset b)
            argv += [part for item in value for part in (flag.name, str(item))]
        elif isinstance(value, bool):
            argv += [flag.name, "yes" if value else "no"]
        else:
            argv += [flag.name, str(value)]
    return argv


def devices(text: str) -> list[str]:
    """--gpus as torch devices: all, a list of indexes, or cpu."""
    text = text.strip().lower()
    if text == "cpu":
        return ["cpu"]
    if text == "all":
        import torch

        count = torch.cuda.device_count()
        if not count:
            raise ConfigError("--gpus all: no CUDA GPU is visible here (torch.cuda.device_count() is 0); "
                              "--gpus cpu runs one worker on the CPU")
        return [f"cuda:{i}" for i in range(count)]
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus {text!r}: give all, cpu, or distinct GPU indexes like 0,1,3")
    return [f"cuda:{i}" for i in ids]


def config(v) -> RunConfig:
    from hsx.prep import resolve_model, resolve_store_url
    from hsx.store import layout
    from hsx_tools.launch import Launch
    from hsx_tools.statedir import default_state_dir

    layout.check_run_name(v["run"])   # it names a folder of logs
    mix = produce.check_flags(v)   # the dataset or mixture, the budgets: refused here, before any process starts
    produce.template_kwargs(v)
    produce.columns(v)
    store = store_settings(v)
    devs = devices(v["gpus"])
    state = Path(v["state_dir"]).expanduser().resolve() if v["state_dir"] else default_state_dir(
        store.url, v["s3_endpoint_url"])
    spool = Path(v["spool_dir"]).expanduser().resolve() if v["spool_dir"] else state / "spool"
    per_worker = v["uploaders_per_gpu"] or (CPU_UPLOADERS if devs == ["cpu"] else
                                            FP8_UPLOADERS if v["store_dtype"] == "float8_e4m3" else GPU_UPLOADERS)
    role = passed(worker.FLAGS, v, WORKER_NOT_PASSED, spool_dir=spool)
    workers = tuple((f"worker-{d.replace('cuda:', 'gpu')}",
                     ("--device", "cpu") if d == "cpu" else ("--gpu", d.split(":")[1]))
                    for d in devs)
    launch = Launch(
        run=v["run"], produce=tuple(passed(produce.FLAGS, v, NOT_PASSED)),
        workers=tuple((name, (*dev, "--wait-for-plan", "--exit-when-complete", *role)) for name, dev in workers),
        upload=tuple(passed(upload.FLAGS, v, NOT_PASSED, spool_dir=spool)), uploaders=per_worker * len(devs),
        logs=state / "logs" / v["run"], verify=v["verify"],
        stop_seconds=v["grace_seconds"] + D.STOP_DEADLINE_MARGIN_SECONDS + D.STOP_SECONDS,
        same_plan={"dataset": str(produce.dataset_of(v, mix)), "model": resolve_model(v["model"]),
                   "store_url": resolve_store_url(store.url), "layer_preset": v["layers"],
                   "token_budget": v["token_budget"], "max_length": v["max_length"]},
        retry_failed=v["retry_failed"], every_s=v["log_every_seconds"])
    given = v["redis_url"]
    return RunConfig(launch, state, redis_url(v) if given else None, given)


def run(cfg: RunConfig) -> int:
    from hsx.redisconn import redact
    from hsx_tools.launch import Signals, Stopped, launch
    from hsx_tools.statedir import StateLock, private_redis

    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    with Signals() as signals, StateLock(cfg.state_dir):
        local = None
        try:
            if cfg.redis_url:
                url = cfg.redis_url
                print(f"state: {cfg.state_dir}; Redis: {redact(url)} (HSX_REDIS_URL)", flush=True)
            else:
                local = private_redis(cfg.state_dir)
                url = local.url
                print(f"state: {cfg.state_dir}; Redis: a private redis-server at {url}, its data in "
                      f"{cfg.state_dir / 'redis'} (stopped with this command, resumed by the next one); "
                      f"meanwhile: HSX_REDIS_URL={url} hsx status --run {cfg.launch.run} --watch", flush=True)
            env["HSX_REDIS_URL"] = cfg.child_redis_url or url
            return launch(cfg.launch, url, env, signals)
        except Stopped as stop:   # before any child started
            print(f"hsx run: stopped ({stop})", flush=True)
            return 128 + stop.signum
        finally:
            if local is not None:
                signals.stopping = True   # a signal now must not cut the Redis's shutdown short
                local.stop()


COMMAND = Command(
    "run", "a whole run on this host in one command: plan, one worker a GPU, uploaders, progress, verify",
    "Uses the Redis HSX_REDIS_URL names, or starts its own persistent redis-server (AOF, noeviction) in the state "
    "folder and says where. Starts `hsx produce`, one `hsx worker` a GPU (or one on the CPU with --gpus cpu) and "
    "the uploaders as child processes with the flags given here (logs in STATE/logs/RUN), shows one live line "
    "(progress, rate, ETA, failures), and exits 0 once the run is complete and verified. Ctrl-C or SIGTERM stops "
    "them cleanly (batches in hand finished or handed back); the same command again resumes, and on a complete "
    "run says so and verifies. More hosts join with `hsx worker` / `hsx upload` on the same Redis "
    "(docs/deploy.md).",
    FLAGS, config, run)
