"""A Redis outage of any length, ridden out by real `hsx worker` and `hsx upload` processes (issue 20).

    .venv/bin/python bench/redis_outage.py --outage-seconds 600

Private redis-server (AOF) on loopback, the tiny model, a local store. The worker (each batch
stretched to --batch-seconds so the outage lands mid-batch) and an uploader run as plain
processes, not in burst mode. Redis is stopped --after-seconds into the run, kept down for
--outage-seconds, restarted on the same port and data; then the run must complete. Prints
whether each role stayed alive through the outage, its Redis lines (lost / back), how many
other log lines it wrote during the outage, failures and dead letters, and the wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hsx.life import ledger
from hsx.redisconn import LocalRedis, connect, free_port
from hsx_tools.demo import sample_dataset
from hsx_tools.tinymodel import build_tiny_model


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--outage-seconds", type=float, default=600)
    p.add_argument("--after-seconds", type=float, default=15)
    p.add_argument("--batch-seconds", type=float, default=1.0)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hsx-outage-"))
    model = build_tiny_model(tmp / "model", sample_path=sample_dataset())
    port = free_port()
    server = LocalRedis(tmp / "redis", port=port).start()
    env = {**os.environ, "HSX_REDIS_URL": server.url, "HSX_SPOOL_DIR": str(tmp / "spool"), "HSX_HOST": "bench"}
    hsx = [sys.executable, "-m", "hsx_cli.main"]
    procs = {}
    try:
        subprocess.run([*hsx, "produce", "--dataset", str(sample_dataset()), "--model", str(model), "--layers",
                        "dflash:3", "--store", str(tmp / "store"), "--run", "out", "--token-budget", "256",
                        "--max-length", "256", "--tokenise-workers", "1"], env=env, check=True, capture_output=True)
        r = connect(server.url)
        batches = int(r.hget("hsx:out:totals", "batches"))
        logs = {name: open(tmp / f"{name}.log", "w") for name in ("worker", "upload")}
        procs["worker"] = subprocess.Popen([*hsx, "worker", "--device", "cpu", "--run", "out", "--log-every-seconds",
                                            "30", "--test-min-batch-seconds", str(args.batch_seconds)],
                                           env=env, stdout=logs["worker"], stderr=subprocess.STDOUT)
        procs["upload"] = subprocess.Popen([*hsx, "upload", "--log-every-seconds", "30"], env=env,
                                           stdout=logs["upload"], stderr=subprocess.STDOUT)
        time.sleep(args.after_seconds)
        done_before = ledger.done_count(r, "out")
        server.stop()
        t_stop = time.monotonic()
        marks = {name: (tmp / f"{name}.log").stat().st_size for name in procs}
        time.sleep(args.outage_seconds)
        alive_at_end_of_outage = {name: proc.poll() is None for name, proc in procs.items()}
        during = {name: (tmp / f"{name}.log").read_bytes()[marks[name]:].decode(errors="replace").splitlines()
                  for name in procs}
        server = LocalRedis(tmp / "redis", port=port).start()
        t_back = time.monotonic()
        r = connect(server.url)
        while ledger.done_count(r, "out") < batches and time.monotonic() - t_back < 900:
            time.sleep(1)
        t_complete = time.monotonic()
        report = {
            "outage_seconds": round(t_back - t_stop, 1), "batches": batches, "done_before_outage": done_before,
            "done": ledger.done_count(r, "out"), "failures": r.hlen("hsx:out:failures"), "dead": r.hlen("hsx:out:dead"),
            "complete_seconds_after_restart": round(t_complete - t_back, 1),
            "alive_at_end_of_outage": alive_at_end_of_outage,
            "alive_after": {name: proc.poll() is None for name, proc in procs.items()},
            "lines_during_outage": {name: len(lines) for name, lines in during.items()},
        }
        time.sleep(3)
        for name in procs:
            text = (tmp / f"{name}.log").read_text(errors="replace").splitlines()
            report[f"{name}_redis_lines"] = [line.split(": ", 1)[-1] for line in text if "hsx.redisconn" in line]
        print(json.dumps(report, indent=2))
        return 0 if report["done"] == batches and all(report["alive_after"].values()) else 1
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
