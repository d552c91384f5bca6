"""A store outage with the spool on a small file system (issue 23 item 1), as real processes.

One run through a private redis-server, one `hsx worker` and one `hsx upload`
(OS processes), moto's S3 behind tests/faultproxy.py, the spool on a tmpfs of
``fs_bytes`` mounted here (root only). The store goes down once the worker has
taken its first jobs (so inputs of the next batches are prefetched), stays down
``outage_seconds`` and, once the spool is full, at least until it has been full for
the (load-scaled) settle time plus OBSERVE_SECONDS, comes back; the run must then
complete. Measured: jobs the worker took during the outage (and over the observed
window of a full spool), batches failed (failure records + dead letters), the
spool's peak use of its file system.

A fixed outage with a load-scaled settle time (the former design) left no window to
observe at load ~8 when the spool filled late in the outage: the count was reported
as -1, a "not measured" sentinel, not a negative count (issue 29 item 12).
Used by tests/test_spool_full.py and bench/spool_full_outage.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hsx.life import heartbeat, ledger
from hsx.redisconn import LocalRedis, connect
from hsx.runspec import spool
from hsx_tools.demo import sample_dataset
from hsx_tools.processes import stop_all
from tests.faultproxy import FaultProxy
from tests.pacedworker import PACED_HSX
from tests.waiting import scaled, wait_until

RUN, HOST, WORKER = "fullspool", "h1", "gpu-fixed"
SETTLE_SECONDS = 4  # from "full" by the file system's room to "no job taken": 1 s heartbeats and 1 s room polls
OBSERVE_SECONDS = 6  # then the window in which the worker must take no job (the outage is stretched to hold it)
MAX_EXTRA_OUTAGE_SECONDS = 60  # (load-scaled) the outage is stretched by at most this, waiting for a full spool


class CannotMount(RuntimeError):
    """This process may not mount a tmpfs (not root, or no CAP_SYS_ADMIN)."""


def mount_tmpfs(path: Path, nbytes: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        raise CannotMount("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode:
        raise CannotMount(f"mount -t tmpfs failed: {out.stderr.strip()}")


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def dataset(path: Path, count: int) -> Path:
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines()]
    with open(path, "w") as fh:
        for i in range(count):
            fh.write(json.dumps({**rows[i % len(rows)], "id": f"s{i:04d}"}) + "\n")
    return path


@dataclass
class OutageReport:
    batches: int                 # planned
    outage_seconds: float
    spool_fs_bytes: int
    jobs_taken_in_outage: int    # extract jobs the worker started while the store was down
    jobs_taken_while_full: int | None  # ... of which after the spool had been full for SETTLE_SECONDS, scaled
                                 # (heartbeats lag, and a batch smaller than the average may still fit just after
                                 # "full" by our measure); None: the spool was never full that long (not measured)
    seconds_full: float          # how long the worker sat with a full spool in the outage
    seconds_observed_full: float  # ... of which after the settle time: the window jobs_taken_while_full covers
    peak_spool_bytes: int        # batch files (and temp files) on the spool file system at most
    failures: int                # failure records + dead letters at the end (every cause)
    dead_letters: int
    complete_after_seconds: float  # store back -> every batch done
    worker_log: str

    def lines(self) -> list[str]:
        return [f"planned batches {self.batches}; outage {self.outage_seconds:.0f} s; spool on a "
                f"{self.spool_fs_bytes / 2**20:.1f} MiB tmpfs (peak {self.peak_spool_bytes / 2**20:.2f} MiB held)",
                f"jobs taken in the outage {self.jobs_taken_in_outage}, of which after the spool filled "
                f"{'(not measured: never full for the settle time)' if self.jobs_taken_while_full is None else self.jobs_taken_while_full}"
                f" over {self.seconds_observed_full:.0f} s; full for {self.seconds_full:.0f} s",
                f"batches failed {self.failures}, dead letters {self.dead_letters}; run complete "
                f"{self.complete_after_seconds:.1f} s after the store returned"]


def _wait(what, predicate, timeout, step=0.2):
    """Poll for ``what``; ``timeout`` is a stall limit on a quiet machine, stretched on a loaded one."""
    return wait_until(what, predicate, timeout, interval=step)


def run_outage(work: Path, model: Path, s3_endpoint: str, bucket: str, outage_seconds: float,
               fs_bytes: int = 1 << 20, samples: int = 160, min_batch_seconds: float = 0.2) -> OutageReport:
    from hsx.runspec.config import StoreSettings
    from producer.produce import produce
    from tests.pipeline import produce_config

    spool_dir, logs = work / "spool", work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    mount_tmpfs(spool_dir, fs_bytes)
    server = LocalRedis(work / "redis").start()
    proxy = FaultProxy(int(s3_endpoint.rsplit(":", 1)[1]))
    proxy.set_mode("up")
    procs = []
    try:
        r = connect(server.url)
        store = StoreSettings(url=f"s3://{bucket}/runs", endpoint_url=proxy.url, region="us-east-1",
                              addressing_style="path")
        produce(produce_config(server.url, model, store, run=RUN, dataset=dataset(work / "data.jsonl", samples),
                               token_budget=512, max_length=512, overlong="truncate", lease_seconds=10))
        batches = ledger.run_totals(r, RUN)["batches"]
        env = {**os.environ, "HSX_REDIS_URL": server.url, "HSX_TEST_MIN_BATCH_SECONDS": str(min_batch_seconds),
               "HSX_S3_ENDPOINT_URL": proxy.url, "HSX_S3_REGION": "us-east-1", "HSX_S3_ADDRESSING_STYLE": "path"}
        common = ["--spool-dir", str(spool_dir), "--host", HOST, "--heartbeat-seconds", "1"]
        worker_log = logs / "worker.log"
        for name, args in (("worker", ["worker", "--run", RUN, "--device", "cpu", "--name", WORKER]),
                           ("uploader", ["upload"])):
            procs.append(subprocess.Popen([*PACED_HSX, *args, *common], env=env,
                                          stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT))

        def live_batches() -> int | None:
            for w in heartbeat.read_workers(r, RUN):
                if w.get("worker") == WORKER and w.get("alive"):
                    return int(w.get("batches", 0))
            return None

        def batches_run() -> int:
            """The worker's batch count from its heartbeat, waiting out a heartbeat that lapsed under load
            (never a -1 for "no heartbeat" taken as a count)."""
            return _wait("the worker's heartbeat", lambda: (n := live_batches()) is not None and (n,), 30)[0]

        _wait("the worker's first jobs", lambda: batches_run() >= 2, 120)
        proxy.set_mode("down")
        t_down = time.monotonic()
        at_down = batches_run()
        peak, full_since, at_full, t_full_settled = 0, None, None, None
        settle, latest = scaled(SETTLE_SECONDS), outage_seconds + scaled(MAX_EXTRA_OUTAGE_SECONDS)

        def outage_over() -> bool:
            elapsed = time.monotonic() - t_down
            if elapsed < outage_seconds:
                return False
            if elapsed >= latest:
                return True        # never full long enough: reported as not measured
            return t_full_settled is not None and time.monotonic() - t_full_settled >= OBSERVE_SECONDS

        while not outage_over():
            used = spool.spool_usage(spool_dir).bytes
            peak = max(peak, used)
            room = spool.free_room(spool_dir)
            if full_since is None and room < used / max(spool.spool_usage(spool_dir).files, 1):  # no room for one more
                full_since = time.monotonic()
            if full_since is not None and at_full is None and time.monotonic() - full_since >= settle:
                at_full, t_full_settled = batches_run(), time.monotonic()
            time.sleep(0.2)
        at_up = batches_run()
        proxy.set_mode("up")
        t_up = time.monotonic()
        _wait("run complete", lambda: ledger.done_count(r, RUN) == batches, 240 + outage_seconds)
        complete_after = time.monotonic() - t_up
        failures = ledger.failures(r, RUN)
        dead = ledger.dead_letters(r, RUN)
        return OutageReport(batches, t_up - t_down, fs_bytes, at_up - at_down,
                            (at_up - at_full) if at_full is not None else None,
                            (t_up - full_since) if full_since else 0.0,
                            (t_up - t_full_settled) if t_full_settled else 0.0, peak,
                            len(failures) + len(dead), len(dead), complete_after, worker_log.read_text())
    finally:
        stop_all(procs)
        proxy.stop()
        server.stop()
        umount(spool_dir)
