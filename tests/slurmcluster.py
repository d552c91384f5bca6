"""A real one-node SLURM cluster for tests: Debian's slurm-wlm (slurmctld + slurmd in the foreground, auth/none,
select/cons_tres, private ports, state in a temp folder), started once per session and stopped by PID. Its
slurm.conf is the one docs/deploy.md gives a user (deploy/slurm/one-node.sh)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from hsx.redisconn import free_port
from tests.waiting import scaled, wait_until

ONE_NODE = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "one-node.sh"


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        """The slurm.conf docs/deploy.md gives ("SLURM on one machine"): deploy/slurm/one-node.sh's, with private
        ports, a KillWait scaled as the test's waits are, and the partition named "test"."""
        env = {**os.environ, "HSX_SLURM_CONF_PORTS": f"{free_port()} {free_port()}",
               "HSX_SLURM_CONF_KILL_WAIT": str(int(scaled(15))), "HSX_SLURM_CONF_PARTITION": "test",
               "HSX_SLURM_CONF_GPUS": "0"}
        out = subprocess.run(["bash", str(ONE_NODE), str(self.root)], capture_output=True, text=True, env=env,
                             timeout=scaled(30), check=True)
        self.conf.write_text(out.stdout)

    def start(self) -> SlurmCluster:
        self.write_conf()
        for daemon in ("slurmctld", "slurmd"):
            log = open(self.root / "log" / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen([daemon, "-D", "-f", str(self.conf)], stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))
            time.sleep(0.5)
        wait_until("the SLURM node idle", lambda: self.node_state() in ("idle", "mixed", "allocated"), 60)
        return self

    def run(self, *args: str, check: bool = True, seconds: float = 60, env: dict | None = None) -> str:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=scaled(seconds), env=env or self.env)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def node_state(self) -> str:
        try:
            return self.run("sinfo", "-h", "-N", "-o", "%T", check=False, seconds=10).strip().rstrip("*")
        except subprocess.TimeoutExpired:
            return ""

    def jobs(self) -> list[dict]:
        """Jobs squeue lists (pending and running): id (array jobs as ID_TASK), state, restarts unknown here."""
        out = self.run("squeue", "-h", "-o", "%i|%T|%j")
        return [dict(zip(("id", "state", "name"), line.split("|"), strict=False)) for line in out.splitlines() if line.strip()]

    def job_field(self, job_id: str, field: str) -> str | None:
        out = self.run("scontrol", "show", "job", job_id, check=False)
        for word in out.split():
            if word.startswith(field + "="):
                return word.split("=", 1)[1]
        return None

    def stop(self) -> None:
        if self.procs and self.procs[0].poll() is None:
            subprocess.run(["scancel", "--full", "--user", os.environ.get("USER", "root")], env=self.env,
                           capture_output=True, timeout=scaled(30))
            try:
                wait_until("SLURM jobs gone", lambda: not self.jobs(), 40)
            except Exception:
                pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=scaled(20))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=scaled(10))


def available() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue"))
