"""`hsx`: one command, a sub-command per role.

Every flag falls back to an HSX_* environment variable (named in its help);
credentials are never flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

from hsx import __version__, defaults as D
from hsx.config import ConfigError, env, hostname, redis_url_from

log = logging.getLogger("hsx")


def _redis_url(args) -> str:
    url = redis_url_from(getattr(args, "redis_url", None))
    if not url:
        raise ConfigError("no Redis: set HSX_REDIS_URL (or REDIS_URL), e.g. redis://127.0.0.1:6379/0")
    return url


def _worker_name(role: str, extra: str = "") -> str:
    """Unique even across containers, where every process may be pid 1 on the same HSX_HOST."""
    import secrets

    return f"{role}-{hostname()}-{extra + '-' if extra else ''}{os.getpid()}-{secrets.token_hex(3)}"


def _add_redis(p):
    p.add_argument("--redis-url", help="Redis URL without a password [HSX_REDIS_URL or REDIS_URL; put passwords there]")


def _add_store(p, required_help: str):
    p.add_argument("--store", default=None, help=f"s3://bucket/prefix or a local directory [HSX_STORE] {required_help}")
    p.add_argument("--s3-endpoint-url", help="any S3-compatible endpoint, e.g. http://minio:9000 [HSX_S3_ENDPOINT_URL, AWS_ENDPOINT_URL]")
    p.add_argument("--s3-region", help="S3 region [HSX_S3_REGION, AWS_REGION]")
    p.add_argument("--s3-addressing-style", choices=("auto", "path", "virtual"), help="S3 addressing [HSX_S3_ADDRESSING_STYLE]")


def _add_spool_role(p, default_name: str, attempts_help: str):
    """Flags shared by the two roles that work off a host's spool (worker, upload)."""
    p.add_argument("--spool-dir", default=env("SPOOL_DIR", "/var/spool/hsx"), help="local spool directory of this host [HSX_SPOOL_DIR; default /var/spool/hsx]")
    p.add_argument("--host", default=hostname(), help="host name of the upload queue upload@HOST; all roles of a host share it [HSX_HOST; default this host's name]")
    p.add_argument("--name", help=f"rq worker name (default {default_name})")
    p.add_argument("--burst", action="store_true", help="drain the queue, then exit")
    p.add_argument("--max-attempts", type=int, default=int(env("MAX_ATTEMPTS", D.DEFAULT_MAX_ATTEMPTS)), help=f"{attempts_help} [HSX_MAX_ATTEMPTS; default {D.DEFAULT_MAX_ATTEMPTS}]")
    p.add_argument("--lease-seconds", type=int, default=int(env("LEASE_SECONDS", D.DEFAULT_LEASE_SECONDS)), help=f"work of a process that stopped heartbeating is re-enqueued this long after its last beat [HSX_LEASE_SECONDS; default {D.DEFAULT_LEASE_SECONDS}]")
    p.add_argument("--heartbeat-seconds", type=float, default=float(env("HEARTBEAT_SECONDS", D.DEFAULT_HEARTBEAT_SECONDS)), help=f"seconds between heartbeats / lease refreshes [HSX_HEARTBEAT_SECONDS; default {D.DEFAULT_HEARTBEAT_SECONDS}]")


def cmd_produce(args) -> int:
    from hsx.config import ProduceConfig, StoreSettings
    from producer.produce import produce

    if not args.dataset or not args.model:
        raise ConfigError("hsx produce needs --dataset and --model (or HSX_DATASET / HSX_MODEL)")
    cfg = ProduceConfig(
        run=args.run, dataset=Path(args.dataset), model=args.model, layers=args.layers,
        store=StoreSettings.resolve(args.store, args.s3_endpoint_url, args.s3_region, args.s3_addressing_style),
        redis_url=_redis_url(args), token_budget=args.token_budget, max_length=args.max_length,
        overlong=args.overlong, max_batch_rows=args.max_batch_rows, pad_multiple=args.pad_multiple,
        dtype=args.dtype, batches_per_shard=args.batches_per_shard, tokenise_workers=args.tokenise_workers,
        enqueue=not args.no_enqueue)
    report = produce(cfg)
    print("\n".join(report.lines()))
    return 0


def cmd_worker(args) -> int:
    from hsx.config import WorkerConfig
    from gpu_worker.worker import run_worker

    device = args.device or (f"cuda:{args.gpu}" if args.gpu is not None else env("DEVICE"))
    if device is None:
        gpu = env("GPU")
        device = f"cuda:{gpu}" if gpu is not None else None
    if device is None:
        raise ConfigError("say which device: --gpu N or --device cpu (or HSX_GPU / HSX_DEVICE)")
    if args.name and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", args.name):
        raise ConfigError(f"--name {args.name!r}: use letters, digits, '.', '_', ':' or '-' (it names spool temp files)")
    cfg = WorkerConfig(
        run=args.run, redis_url=_redis_url(args), device=device, spool_dir=Path(args.spool_dir),
        spool_budget_bytes=int(args.spool_budget_gb * 2**30), host=args.host, model_override=args.model,
        burst=args.burst, worker_name=args.name or _worker_name("gpu", device.replace(":", "")),
        max_attempts=args.max_attempts, lease_seconds=args.lease_seconds,
        heartbeat_seconds=args.heartbeat_seconds, grace_seconds=args.grace_seconds,
        min_batch_seconds=float(env("TEST_MIN_BATCH_SECONDS", "0")), wait_for_plan=args.wait_for_plan)
    rt = run_worker(cfg)
    print(f"worker {cfg.worker_name}: {rt.batches_run} batches, {rt.tokens_run} tokens, {rt.writer.written} spooled")
    return 0


def cmd_upload(args) -> int:
    from hsx.config import UploadConfig
    from uploader.worker import run_uploader

    run_uploader(UploadConfig(redis_url=_redis_url(args), spool_dir=Path(args.spool_dir), host=args.host,
                              burst=args.burst, worker_name=args.name or _worker_name("upload"),
                              max_attempts=args.max_attempts, lease_seconds=args.lease_seconds,
                              heartbeat_seconds=args.heartbeat_seconds))
    return 0


def cmd_status(args) -> int:
    from hsx import ledger
    from hsx.progress import run_progress, summary_lines
    from hsx.redisconn import connect

    r = connect(_redis_url(args), retries=2)
    runs = [args.run] if args.run else ledger.list_runs(r)
    if not runs:
        print("no runs in this Redis")
        return 1
    if args.watch:
        from hsx_tools.watch import watch

        return watch(r, runs[0], args.interval)
    reports = [run_progress(r, run) for run in runs]
    if args.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2, default=str))
    else:
        for p in reports:
            print("\n".join(summary_lines(p)))
    return 0


def cmd_retry_failed(args) -> int:
    from hsx import queues
    from hsx.redisconn import connect

    r = connect(_redis_url(args))
    taken = queues.retry_dead_letters(r, args.run, args.batch or None)
    print(f"re-enqueued {len(taken)} dead-letter batches of run {args.run}")
    return 0


def cmd_demo(args) -> int:
    from hsx_tools.demo import run_demo

    return run_demo(Path(args.store), Path(args.workdir), samples=args.samples)


def cmd_demo_assets(args) -> int:
    import filecmp
    import shutil

    from hsx_tools.demo import sample_dataset
    from hsx_tools.tinymodel import build_tiny_model

    out = Path(args.out)
    model = build_tiny_model(out / "tiny-qwen3", sample_path=sample_dataset())
    dataset = out / "sample_conversations.jsonl"
    if not dataset.exists() or not filecmp.cmp(sample_dataset(), dataset, shallow=False):
        shutil.copyfile(sample_dataset(), dataset)
    print(f"model: {model}\ndataset: {dataset}")
    return 0


def cmd_dashboard(args) -> int:
    try:
        from dashboard.app import serve
    except ImportError as exc:
        raise ConfigError(f"the dashboard is not available in this install ({exc})") from None
    return serve(args)


def cmd_export(args) -> int:
    from hsx_tools.export import run_export

    return run_export(args)


def cmd_verify(args) -> int:
    from hsx_tools.verify import run_verify

    return run_verify(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hsx", description="Extract hidden states from a target LLM into S3, "
                                "for training speculative-decoding drafters. Roles meet in Redis.")
    p.add_argument("--version", action="version", version=f"hsx {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("produce", help="plan a run and enqueue its batches (safe to re-run)",
                       description="Tokenise the dataset with the model's chat template, cut length-bucketed batches "
                       "under a token budget, record plan and manifest in Redis and the store, and enqueue every "
                       "batch that is neither done nor pending.")
    s.add_argument("--dataset", default=env("DATASET"), help="JSONL, Parquet or a `datasets` folder [HSX_DATASET]")
    s.add_argument("--model", default=env("MODEL"), help="target model: local path or hub id [HSX_MODEL]")
    s.add_argument("--layers", default=env("LAYERS", "dflash"), help="dflash, dflash:N, eagle3 or a list like 1,9,17 [HSX_LAYERS; default dflash]")
    s.add_argument("--run", default=env("RUN", "default"), help="run name [HSX_RUN; default 'default']")
    _add_store(s, "(required)")
    _add_redis(s)
    s.add_argument("--token-budget", type=int, default=int(env("TOKEN_BUDGET", D.DEFAULT_TOKEN_BUDGET)), help=f"padded tokens a batch [HSX_TOKEN_BUDGET; default {D.DEFAULT_TOKEN_BUDGET}]")
    s.add_argument("--max-length", type=int, default=int(env("MAX_LENGTH", D.DEFAULT_MAX_LENGTH)), help=f"tokens a sample [HSX_MAX_LENGTH; default {D.DEFAULT_MAX_LENGTH}]")
    s.add_argument("--overlong", choices=("drop", "truncate"), default=env("OVERLONG", "drop"), help="what to do with samples over --max-length (counted either way) [HSX_OVERLONG; default drop]")
    s.add_argument("--max-batch-rows", type=int, default=int(env("MAX_BATCH_ROWS", D.DEFAULT_MAX_BATCH_ROWS)), help=f"samples a batch at most [default {D.DEFAULT_MAX_BATCH_ROWS}]")
    s.add_argument("--pad-multiple", type=int, default=int(env("PAD_MULTIPLE", D.DEFAULT_PAD_MULTIPLE)), help=f"round padded row length up to this [default {D.DEFAULT_PAD_MULTIPLE}]")
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=env("DTYPE", D.DEFAULT_DTYPE), help=f"stored dtype [HSX_DTYPE; default {D.DEFAULT_DTYPE}]")
    s.add_argument("--batches-per-shard", type=int, default=int(env("BATCHES_PER_SHARD", D.DEFAULT_BATCHES_PER_SHARD)), help=f"batches a store shard folder [default {D.DEFAULT_BATCHES_PER_SHARD}]")
    s.add_argument("--tokenise-workers", type=int, default=int(env("TOKENISE_WORKERS", "1")), help="processes tokenising in parallel [HSX_TOKENISE_WORKERS; default 1]")
    s.add_argument("--no-enqueue", action="store_true", help="plan only; enqueue nothing")
    s.set_defaults(func=cmd_produce)

    s = sub.add_parser("worker", help="run extract jobs on one GPU (or the CPU), model loaded once",
                       description="An rq worker on the run's extract queue. Loads the model once, runs each batch, "
                       "writes one packed safetensors file per batch into the local spool and enqueues its upload "
                       "on this host's upload queue. Stops taking jobs while the spool is over budget.")
    s.add_argument("--run", default=env("RUN", "default"), help="run to serve [HSX_RUN]")
    dev = s.add_mutually_exclusive_group()
    dev.add_argument("--gpu", type=int, help="GPU index (cuda:N) [HSX_GPU]")
    dev.add_argument("--device", help="torch device, e.g. cpu or cuda:1 [HSX_DEVICE]")
    _add_spool_role(s, "gpu-HOST-DEVICE-PID-XXXXXX", "attempts before a batch goes to dead letters")
    s.add_argument("--spool-budget-gb", type=float, default=float(env("SPOOL_BUDGET_GB", D.DEFAULT_SPOOL_BUDGET_BYTES / 2**30)), help=f"GiB of finished files the spool may hold before the worker waits [HSX_SPOOL_BUDGET_GB; default {D.DEFAULT_SPOOL_BUDGET_BYTES // 2**30}]")
    s.add_argument("--model", default=env("WORKER_MODEL"), help="local path of the run's model if it differs from the manifest's [HSX_WORKER_MODEL]")
    s.add_argument("--wait-for-plan", action="store_true", default=env("WAIT_FOR_PLAN", "0") not in ("0", "", "false"),
                   help="if the run is not planned yet, wait for `hsx produce` instead of exiting [HSX_WAIT_FOR_PLAN]")
    s.add_argument("--grace-seconds", type=float, default=float(env("GRACE_SECONDS", D.DEFAULT_GRACE_SECONDS)), help=f"on SIGTERM, seconds to finish writing computed batches before handing the rest back [HSX_GRACE_SECONDS; default {D.DEFAULT_GRACE_SECONDS}]")
    _add_redis(s)
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser("upload", help="upload spool files of this host, verify, record done",
                       description="An rq worker on upload@HOST: uploads each batch file (multipart when large), "
                       "verifies size and checksum in the store, records the batch done in the ledger, then deletes "
                       "the local file. Run several per host.")
    _add_spool_role(s, "upload-HOST-PID-XXXXXX", "re-extractions of a lost spool file before dead letters")
    _add_redis(s)
    s.set_defaults(func=cmd_upload)

    s = sub.add_parser("status", help="progress of a run from the ledger")
    s.add_argument("--run", default=env("RUN"), help="run (default: every run in this Redis) [HSX_RUN]")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--watch", action="store_true", help="live progress bars in the terminal")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between --watch refreshes")
    _add_redis(s)
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("retry-failed", help="re-enqueue batches from the dead-letter record")
    s.add_argument("--run", default=env("RUN", "default"), help="run [HSX_RUN]")
    s.add_argument("--batch", action="append", help="only this batch id (repeatable)")
    _add_redis(s)
    s.set_defaults(func=cmd_retry_failed)

    s = sub.add_parser("dashboard", help="live web dashboard (with rq-dashboard at /rq)")
    s.add_argument("--bind", default=env("DASHBOARD_BIND", D.DEFAULT_DASHBOARD_HOST), help="address to bind [HSX_DASHBOARD_BIND; default 127.0.0.1]")
    s.add_argument("--port", type=int, default=int(env("DASHBOARD_PORT", D.DEFAULT_DASHBOARD_PORT)), help=f"port [HSX_DASHBOARD_PORT; default {D.DEFAULT_DASHBOARD_PORT}]")
    _add_redis(s)
    s.set_defaults(func=cmd_dashboard)

    s = sub.add_parser("verify", help="check the store against the plan; non-zero exit on any gap",
                       description="Every planned batch present in the store with the right size and checksum, every "
                       "sample id exactly once, hidden states finite. Prints a summary; exits 1 on any gap.")
    s.add_argument("--run", default=env("RUN", "default"), help="run [HSX_RUN]")
    s.add_argument("--quick", action="store_true", help="size and checksum metadata only; do not read every object")
    _add_redis(s)
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("export", help="write a finished run in the per-sample layout a drafter trainer reads",
                       description="Export each sample of a completed run as SpecForge (data_<i>.ckpt under rows_*/) "
                       "or vLLM speculators (hs_<i>.safetensors) files. Resumable: existing files are skipped.")
    s.add_argument("--run", default=env("RUN", "default"), help="run [HSX_RUN]")
    s.add_argument("--format", choices=("specforge", "speculators"), required=True, help="target trainer layout")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--limit", type=int, help="export at most this many samples")
    s.add_argument("--shard", help="only this store shard (e.g. 00003)")
    _add_store(s, "(default: the run's recorded store)")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("demo", help="the embedded default: the whole pipeline on this machine, tiny model, no network",
                       description="Starts a private redis-server if none is reachable at HSX_REDIS_URL, builds a tiny "
                       "random Qwen3 model and a real tokenizer locally, plans the shipped sample conversations, and "
                       "runs a worker (CPU) and two uploaders as processes into a local-directory store.")
    s.add_argument("--store", default=env("STORE", "hsx-out"), help="local output directory [default ./hsx-out]")
    s.add_argument("--workdir", default=".hsx", help="scratch for Redis data, spool and the tiny model [default ./.hsx]")
    s.add_argument("--samples", type=int, default=None, help="use only the first N shipped conversations")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("demo-assets", help="write the embedded default's tiny model and sample conversations to a folder",
                       description="Builds the tiny random Qwen3 model (with its tokenizer) and copies the shipped "
                       "sample conversations into OUT, for `hsx produce` and workers that run as separate processes "
                       "or containers (docker-compose.cpu.yml). Does nothing that is already there.")
    s.add_argument("--out", required=True, help="folder to write tiny-qwen3/ and sample_conversations.jsonl into")
    s.set_defaults(func=cmd_demo_assets)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "rq.worker", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return args.func(args) or 0
    except (ConfigError, ValueError, RuntimeError, FileNotFoundError, KeyError) as exc:
        if args.verbose:
            raise
        print(f"hsx {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
