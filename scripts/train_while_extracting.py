"""Train while extracting, on the demo's tiny model, on CPU: hsx produce, a worker and an uploader start, and
a trainer in this process steps on each batch as soon as the ledger records it done (hsx_reader.RunFollower).

    .venv/bin/python scripts/train_while_extracting.py --workdir /tmp/twe                  # whole run
    .venv/bin/python scripts/train_while_extracting.py --workdir /tmp/twe --stop-after 10  # "crash" at step 10
    .venv/bin/python scripts/train_while_extracting.py --workdir /tmp/twe --resume         # go on from the cursor

The trainer is a stand-in drafter (a linear head from the stored layers to the next token; what matters is
where its batches come from): each step prints its loss, the batches the ledger has recorded done of those
planned, and the cursor it saves to WORKDIR/cursor after the step. --resume reuses the extraction of a
previous call (its Redis data and store in WORKDIR) and the saved cursor.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hsx.redisconn import LocalRedis, connect
from hsx.run.keys import RunKeys
from hsx_reader import RunFollower, collate_packed
from hsx_tools.demo import sample_dataset
from hsx_tools.processes import stop_all
from hsx_tools.tinymodel import build_tiny_model

RUN = "twe"


def hsx(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsx_cli.main", *args]


def start_extraction(workdir: Path, env: dict, slow: float) -> list[subprocess.Popen]:
    model = build_tiny_model(workdir / "tiny-qwen3", sample_path=sample_dataset())
    subprocess.run(hsx("produce", "--run", RUN, "--dataset", str(sample_dataset()), "--model", str(model),
                       "--layers", "dflash:3", "--store", str(workdir / "store"), "--token-budget", "512",
                       "--dtype", "float32", "--max-length", "512", "--overlong", "truncate"), env=env, check=True)
    spool = str(workdir / "spool")
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    env = {**env, "HSX_TEST_MIN_BATCH_SECONDS": str(slow)}   # a slower "GPU", so training visibly overlaps
    return [subprocess.Popen(hsx("worker", "--run", RUN, "--device", "cpu", "--spool-dir", spool, "--host", "twe",
                                 "--burst"), env=env, stdout=open(logs / "worker.log", "a"), stderr=subprocess.STDOUT),
            subprocess.Popen(hsx("upload", "--spool-dir", spool, "--host", "twe"), env=env,
                             stdout=open(logs / "upload.log", "a"), stderr=subprocess.STDOUT)]


def train(redis_url: str, workdir: Path, resume: bool, stop_after: int | None) -> int:
    cursor_file = workdir / "cursor"
    cursor = cursor_file.read_text().strip() if resume and cursor_file.exists() else None
    follower = RunFollower(redis_url, RUN, cursor=cursor, timeout_seconds=300)
    width, r = follower.manifest.width, connect(redis_url)
    torch.manual_seed(0)
    head = torch.nn.Linear(width, 512)          # the tiny model's vocabulary is under 512 ids
    state = workdir / "drafter.pt"
    if resume and state.exists():
        head.load_state_dict(torch.load(state))
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    print(f"trainer: following run {RUN} from cursor {cursor or '0:0'}")
    step = 0
    for batch in DataLoader(follower, batch_size=8, collate_fn=collate_packed):
        hidden, ids = batch["hidden_states"][0].float(), batch["input_ids"][0]
        same_sample = batch["position_ids"][0][1:] != 0
        loss = torch.nn.functional.cross_entropy(head(hidden[:-1][same_sample]), ids[1:][same_sample])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        keys = RunKeys(RUN)
        done, planned = r.scard(keys.done), r.hget(keys.totals, "batches")
        torch.save(head.state_dict(), state)
        cursor_file.write_text(batch["cursor"])      # after the step: a restart goes on with the next sample
        print(f"step {step:3d}  loss {loss.item():.3f}  ledger {done}/{int(planned)} batches done  cursor {batch['cursor']}")
        if stop_after and step >= stop_after:
            print(f"trainer: stopping after {step} steps (restart with --resume)")
            return 0
    print(f"trainer: run {RUN} is COMPLETE; {follower.stats.samples} samples in {step} steps")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true", help="go on from WORKDIR/cursor (no new extraction)")
    parser.add_argument("--stop-after", type=int, default=None, help="stop the trainer after N steps")
    parser.add_argument("--batch-seconds", type=float, default=0.5, help="slow the CPU worker to this per batch")
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis(workdir / "redis").start()
    env = {**os.environ, "HSX_REDIS_URL": redis.url}
    procs: list[subprocess.Popen] = []
    try:
        if not args.resume:
            procs = start_extraction(workdir, env, args.batch_seconds)
        elif connect(redis.url).llen(RunKeys(RUN).done_seq) == 0:
            print(f"nothing extracted in {workdir} yet: run without --resume first", file=sys.stderr)
            return 2
        else:   # extraction of the first call goes on where it stopped
            procs = start_extraction_resume(workdir, env, args.batch_seconds)
        return train(redis.url, workdir, args.resume, args.stop_after)
    finally:
        stop_all(procs)
        redis.stop()


def start_extraction_resume(workdir: Path, env: dict, slow: float) -> list[subprocess.Popen]:
    """A worker and an uploader for what is left (the plan and the ledger are in Redis already)."""
    spool = str(workdir / "spool")
    env = {**env, "HSX_TEST_MIN_BATCH_SECONDS": str(slow)}
    logs = workdir / "logs"
    return [subprocess.Popen(hsx("worker", "--run", RUN, "--device", "cpu", "--spool-dir", spool, "--host", "twe",
                                 "--burst"), env=env, stdout=open(logs / "worker.log", "a"), stderr=subprocess.STDOUT),
            subprocess.Popen(hsx("upload", "--spool-dir", spool, "--host", "twe"), env=env,
                             stdout=open(logs / "upload.log", "a"), stderr=subprocess.STDOUT)]


if __name__ == "__main__":
    sys.exit(main())
