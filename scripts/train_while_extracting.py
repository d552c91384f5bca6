"""Train while extracting, on the demo's tiny model: hsx produce, a worker and an uploader start, and
speculators' own trainer (`speculators train`, EAGLE-3) follows the run through its ledger, a training step
per batch as soon as the ledger records it done (peers/hsx_peers/speculators_follow.py).

    .venv/bin/python scripts/train_while_extracting.py --workdir /tmp/twe                    # whole run
    .venv/bin/python scripts/train_while_extracting.py --workdir /tmp/twe --stop-at-checkpoint  # "crash" there
    .venv/bin/python scripts/train_while_extracting.py --workdir /tmp/twe --resume           # go on from it

The trainer runs in speculators' venv (scripts/peers.sh makes it; --python another) as
`python -m hsx_peers.speculators train --hidden-states-backend hsx --hsx-run twe --hsx-mode follow ...`, with
HSX_REDIS_URL in its environment. speculators 0.9.0's Trainer puts the drafter on an accelerator; without one
(no CUDA here) the script runs the same command through tests/peers/train_speculators.py, the CPU device shim
the tests use. Each step prints the batch it trained on, the ledger's batches done of those planned when the
trainer took it, and the cursor after it. --stop-at-checkpoint kills the trainer right after speculators'
first mid-epoch checkpoint (WORKDIR/ckpt, every quarter of the run); --resume starts extraction's worker and
uploader again for what is left and the trainer with the same --save-path: speculators' own resume goes on
from the checkpoint's step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from hsx import life
from hsx.redisconn import LocalRedis, connect
from hsx_tools.demo import sample_dataset
from hsx_tools.processes import stop_all
from hsx_tools.tinymodel import build_tiny_model

RUN = "twe"
ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = ROOT / ".peers" / "speculators" / "bin" / "python"
CPU_SHIM = ROOT / "tests" / "peers" / "train_speculators.py"
PACED = ROOT / "tests" / "pacedworker.py"   # `hsx` whose worker batches last HSX_TEST_MIN_BATCH_SECONDS


def hsx(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsx_cli.main", *args]


def model_dir(workdir: Path) -> Path:
    return build_tiny_model(workdir / "tiny8", num_layers=8, sample_path=sample_dataset())


def start_roles(workdir: Path, env: dict, batch_seconds: float) -> list[subprocess.Popen]:
    """A worker (a slowed CPU "GPU", so training visibly overlaps) and an uploader for what the plan has left."""
    spool, logs = str(workdir / "spool"), workdir / "logs"
    env = {**env, "HSX_TEST_MIN_BATCH_SECONDS": str(batch_seconds)}
    return [subprocess.Popen([sys.executable, str(PACED), "worker", "--run", RUN, "--device", "cpu", "--spool-dir", spool,
                              "--host", "twe", "--burst"], env=env, stdout=open(logs / "worker.log", "a"), stderr=subprocess.STDOUT),
            subprocess.Popen(hsx("upload", "--spool-dir", spool, "--host", "twe"), env=env,
                             stdout=open(logs / "upload.log", "a"), stderr=subprocess.STDOUT)]


def produce(workdir: Path, env: dict) -> None:
    subprocess.run(hsx("produce", "--run", RUN, "--dataset", str(sample_dataset()), "--model", str(model_dir(workdir)),
                       "--layers", "eagle3", "--store", str(workdir / "store"), "--token-budget", "1024",
                       "--dtype", "float32", "--max-length", "1024", "--overlong", "truncate"), env=env, check=True)


def trainer_command(python: Path, workdir: Path, layer_ids: list[int]) -> list[str]:
    flags = ["--verifier-name-or-path", str(model_dir(workdir)), "--speculator-type", "eagle3",
             "--data-path", str(workdir / "spec-data"), "--hidden-states-backend", "hsx", "--hsx-run", RUN,
             "--hsx-mode", "follow", "--hsx-follow-log", str(workdir / "follow.jsonl"),
             "--target-layer-ids", *[str(x + 1) for x in layer_ids], "--on-missing", "raise", "--epochs", "1",
             "--num-workers", "0", "--total-seq-len", "1024", "--checkpoint-freq", "0.25",
             "--save-path", str(workdir / "ckpt"), "--lr", "1e-2", "--log-freq", "1", "--draft-attn-impl", "sdpa",
             "--loss-implementation", "eager", "--seed", "0"]
    if torch.cuda.is_available():
        return [str(python), "-m", "hsx_peers.speculators", "train", *flags]
    return [str(python), str(CPU_SHIM), json.dumps([flags])]


def follow(trainer: subprocess.Popen, workdir: Path, run: life.Run, stop_at_checkpoint: bool) -> int:
    """Print each step the trainer takes (from its follow log) until it exits; 0 when it finished the run."""
    log, state = workdir / "follow.jsonl", workdir / "ckpt" / "0" / "training_state.json"
    seen = len(log.read_text().splitlines()) if log.exists() else 0     # lines of an earlier call
    checkpointed = state.read_text() if state.exists() else None
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        for line in lines[seen:]:
            record = json.loads(line)
            if "step" in record:
                left = run.outstanding()
                done, planned = left.done, left.batches or 0
                print(f"step {record['step']:3d}  batch {record['batch_id']}  ({len(record['sample_ids'])} samples)  "
                      f"ledger {done}/{planned} batches done  cursor {record['cursor']}", flush=True)
        seen = len(lines)
        if stop_at_checkpoint and state.exists() and state.read_text() != checkpointed:
            trainer.kill()
            trainer.wait()
            step = json.loads(state.read_text())["local_step"]
            print(f"trainer: killed after speculators' checkpoint of its first {step} steps (0-{step - 1}); --resume "
                  f"goes on from step {step}")
            return 0
        if trainer.poll() is not None:
            if trainer.returncode:
                tail = (workdir / "logs" / "trainer.log").read_text().splitlines()[-15:]
                print("trainer failed:\n" + "\n".join(tail), file=sys.stderr)
            return trainer.returncode
        time.sleep(0.2)


def step_losses(trainer_log: Path) -> list[float]:
    """The losses of the trainer's steps in this call: the CPU shim's last line ({"losses": [[...]]}); [] where the
    trainer ran without it (with CUDA: speculators' own log lines carry them)."""
    lines = trainer_log.read_text().splitlines() if trainer_log.exists() else []
    try:
        report = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return []
    return [x for run in report.get("losses", []) for x in run] if isinstance(report, dict) else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="go on from speculators' checkpoint in WORKDIR/ckpt")
    parser.add_argument("--stop-at-checkpoint", action="store_true",
                        help="kill the trainer right after its first mid-epoch checkpoint")
    parser.add_argument("--batch-seconds", type=float, default=2.0, help="slow the CPU worker to this per batch")
    parser.add_argument("--python", type=Path, default=SPECULATORS_PYTHON, help="python of speculators' venv")
    args = parser.parse_args()
    if not args.python.exists():
        print(f"no speculators venv at {args.python}: run scripts/peers.sh (or pass --python)", file=sys.stderr)
        return 2
    workdir = args.workdir.resolve()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "spec-data").mkdir(exist_ok=True)
    redis = LocalRedis(workdir / "redis").start()
    env = {**os.environ, "HSX_REDIS_URL": redis.url}
    trainer_env = {k: v for k, v in env.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    trainer_env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'peers'}", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    run, procs = life.Run(connect(redis.url), RUN), []
    try:
        if args.resume and not run.exists():
            print(f"nothing extracted in {workdir} yet: run without --resume first", file=sys.stderr)
            return 2
        if not args.resume:
            produce(workdir, env)
        layer_ids = list(run.require_manifest().layer_ids)
        trainer = subprocess.Popen(trainer_command(args.python, workdir, layer_ids), cwd=workdir, env=trainer_env,
                                   stdout=open(workdir / "logs" / "trainer.log", "a"), stderr=subprocess.STDOUT)
        procs = [trainer, *start_roles(workdir, env, args.batch_seconds)]   # trainer and extraction together
        print(f"trainer: speculators train following run {RUN} (log: {workdir / 'logs' / 'trainer.log'})")
        rc = follow(trainer, workdir, run, args.stop_at_checkpoint)
        if rc == 0 and trainer.returncode == 0:
            print(f"trainer: run {RUN} is COMPLETE and trained on; drafter in {workdir / 'ckpt'}")
            losses = step_losses(workdir / "logs" / "trainer.log")
            if losses:
                print(f"loss over this call's {len(losses)} steps: {losses[0]:.4f} -> {losses[-1]:.4f} (every step: "
                      + " ".join(f"{x:.4f}" for x in losses) + ")")
        return rc
    finally:
        stop_all(procs)
        redis.stop()


if __name__ == "__main__":
    sys.exit(main())
