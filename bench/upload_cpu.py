"""CPU seconds per GiB of one S3Store.put_file, in this process, against `rclone serve s3` on loopback (issue 28).

The upload bench (bench/upload_bench.py) measures whole uploader processes; this one isolates the store's hot
path so each change's share can be told: it uploads one spool-sized file (--mib, multipart above 64 MiB)
--repeat times and reports the process's CPU (all threads, time.process_time) per GiB, beside the cost of each
pass the path may make over the bytes (MD5, SHA-256, CRC32, a copy into fresh memory), measured on the same
machine now. Optional py-spy profile of the uploads: --profile FILE (py-spy on PATH or beside python).

--integrity (hsx's --s3-integrity) picks the check: auto probes the server (rclone and moto check no CRC32, so
auto is md5 there; SeaweedFS checks it, so auto is crc32 there); crc32 demands x-amz-checksum-crc32 and no MD5,
and is refused where the probe does not show the server checking it (rclone, moto). So crc32 is measured against
--server seaweedfs (`weed mini`, tests/seaweedfs.py, in its own process: its CPU is not counted). --server moto
runs moto_server in its own process.

  .venv/bin/python bench/upload_cpu.py --mib 512 --repeat 3
  .venv/bin/python bench/upload_cpu.py --mib 256 --repeat 3 --server seaweedfs --integrity crc32
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from upload_bench import BUCKET, make_source  # noqa: E402

from hsx.digest import file_sha256  # noqa: E402
from hsx.redisconn import free_port  # noqa: E402
from hsx.store.quirks import EndpointQuirks  # noqa: E402
from hsx.store.s3 import S3Settings, S3Store  # noqa: E402
from tests.rclone import RcloneS3  # noqa: E402
from tests.seaweedfs import SeaweedS3  # noqa: E402

GiB = 2**30


class MotoServer:
    """moto_server (beside python) on a free loopback port, in its own process; stopped by PID."""

    def __init__(self, log_path: Path):
        import socket

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1",
                                          "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def pass_costs(block_mib: int = 64, rounds: int = 4) -> dict[str, float]:
    """CPU s/GiB of one pass of each kind over 64 MiB blocks, here and now."""
    block = os.urandom(block_mib * 2**20)
    kinds = {"md5": lambda b: hashlib.md5(b).digest(), "sha256": lambda b: hashlib.sha256(b).digest(),
             "crc32": zlib.crc32, "copy to fresh memory": lambda b: bytearray(b)}
    costs = {}
    for name, fn in kinds.items():
        start = time.process_time()
        for _ in range(rounds):
            fn(block)
        costs[name] = round((time.process_time() - start) / (rounds * block_mib / 1024), 3)
    return costs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=512, help="file size, MiB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tmp", default="/dev/shm")
    p.add_argument("--profile", default="", help="write py-spy collapsed stacks of the uploads here")
    p.add_argument("--server", choices=("rclone", "moto", "seaweedfs"), default="rclone")
    p.add_argument("--integrity", choices=("auto", "md5", "crc32"), default="auto", help="hsx's --s3-integrity")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="hsx-upload-cpu-", dir=args.tmp))
    if args.server == "rclone":
        import secrets

        (work / "server" / BUCKET).mkdir(parents=True)
        server = RcloneS3(work / "server", work / "rclone.log",
                          keys=(f"bench{secrets.token_hex(6)}", secrets.token_hex(20))).start()
    elif args.server == "seaweedfs":
        import secrets

        # a throwaway key pair, in the environment only (weed takes it from there: never on a command line)
        os.environ.update({"AWS_ACCESS_KEY_ID": f"bench{secrets.token_hex(6)}",
                           "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20), "AWS_DEFAULT_REGION": "us-east-1"})
        server = SeaweedS3(work / "seaweedfs", work / "weed.log").start()
    else:
        server = MotoServer(work / "moto.log")
    try:
        os.environ.update(server.env())
        if args.server in ("moto", "seaweedfs"):
            import boto3

            boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket=BUCKET)
        store = S3Store(S3Settings(bucket=BUCKET, prefix="cpu", endpoint_url=server.url, region="us-east-1",
                                   quirks=EndpointQuirks(addressing_style="path", integrity=args.integrity)))
        checks = store.checks_line()
        size = args.mib * 2**20
        source = work / "batch.safetensors"
        make_source(source, size)
        sha256 = file_sha256(source)
        store.put_file("warm", source, size, sha256)
        if args.server in ("moto", "seaweedfs"):
            store.delete("warm")  # moto holds objects in memory
        spy = None
        if args.profile:
            binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            spy = subprocess.Popen([binary, "record", "-p", str(os.getpid()), "-o", args.profile, "--threads",
                                    "--nonblocking", "-r", "200", "-f", "raw"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        cpu = wall = 0.0
        for i in range(args.repeat):
            started_cpu, started = time.process_time(), time.monotonic()
            store.put_file(f"b{i}", source, size, sha256)
            cpu, wall = cpu + time.process_time() - started_cpu, wall + time.monotonic() - started
            (work / "server" / BUCKET / "cpu" / f"b{i}").unlink(missing_ok=True)  # not counted: the server's bytes
            if args.server in ("moto", "seaweedfs"):
                store.delete(f"b{i}")
        if spy:
            spy.send_signal(2)
            spy.wait(timeout=60)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    gib = args.repeat * size / GiB
    report = {"file_mib": args.mib, "repeat": args.repeat, "server": args.server, "checks": checks,
              "client_cpu_s_per_gib": round(cpu / gib, 3),
              "wall_gib_s": round(gib / wall, 3), "pass_costs_s_per_gib": pass_costs(), "load": os.getloadavg()}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
