"""A real one-node SLURM cluster for tests: Debian's slurm-wlm (slurmctld + slurmd in the foreground, auth/none,
select/cons_tres, private ports, state in a temp folder), started once per session and stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.waiting import scaled, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as fh:
        total_kb = int(next(line for line in fh if line.startswith("MemTotal")).split()[1])
    return int(total_kb / 1024 * 0.8)


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
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 2
        self.conf.write_text("\n".join([
            "ClusterName=hsxtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/none", "CredType=cred/none",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            "MpiDefault=none", "SwitchType=switch/none", "ReturnToService=2", "JobRequeue=1",
            f"KillWait={int(scaled(15))}", "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=5,sched_interval=5", "MinJobAge=600",
            # KillWait: SIGTERM to SIGKILL; a cancelled task drains its spool and logs in it (slower when loaded)
            # a requeued job waits cred_expire + 1 s before it may start again (120 s by default)
            "AuthInfo=cred_expire=10",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={_memory_mb()} State=UNKNOWN",
            # Tasks share the cores (CPU workers of a test spend most of their time waiting)
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        ]) + "\n")

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
