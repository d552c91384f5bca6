"""The compose services, run as plain processes on loopback, exactly as `docker-compose config`
resolves them: the same `hsx` commands and environment (env_file included), with only what a
container runtime would provide swapped in:

- service host names in URLs (redis) -> the test's private redis-server on 127.0.0.1;
- each mount's container path -> a folder of this test (named volume) or the bind-mounted folder,
  so services that share a volume share a folder;
- `--gpu N` -> `--device cpu` (no GPU here), `--bind 0.0.0.0 --port P` -> loopback and a free port.

test_compose_run_adds_a_worker_mid_run: docker-compose.yml against moto's S3 server. The producer
plans and exits 0, two uploaders (`--scale uploader=2`) and gpu_worker_0 start, then gpu_worker_1
joins while batches are still queued (`docker compose up -d gpu_worker_1`) and must take some.
test_compose_cpu_override_runs_the_demo: docker-compose.yml + docker-compose.cpu.yml, local store.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit, urlunsplit

import pytest

from hsx.life import heartbeat, ledger
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress
from hsx.redisconn import free_port
from hsx_tools.demo import sample_dataset
from tests.test_compose import BASE, CPU_OVERRIDE, HSX_BIN, active_services, compose_config, mounts, role, write_project
from tests.threads import thread_env
from tests.waiting import scaled, wait_until

pytestmark = pytest.mark.slow


class ComposeAsProcesses:
    """Starts resolved compose services as local processes; logs go to files, shown on failure."""

    def __init__(self, config: dict, workdir: Path, redis_url: str):
        self.config, self.workdir, self.redis = config, workdir, urlsplit(redis_url)
        self.services = active_services(config)
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []
        self.ports: dict[str, int] = {}
        (workdir / "home").mkdir(parents=True, exist_ok=True)

    # ---- translation of one service -------------------------------------------------------------
    def _host_dir(self, source: str) -> Path:
        if source.startswith("/"):  # bind mount: the host folder itself
            return Path(source)
        path = self.workdir / "volumes" / source
        path.mkdir(parents=True, exist_ok=True)
        return path

    def local_path(self, service: str, container_path: str) -> str:
        svc, path = self.services[service], PurePosixPath(container_path)
        for target, source in sorted(mounts(svc).items(), key=lambda m: -len(m[0])):
            if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
                return str(self._host_dir(source) / path.relative_to(target))
        return container_path

    def _localise(self, service: str, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme == "redis" and parts.hostname in self.services:
            return urlunsplit(parts._replace(netloc=self.redis.netloc))
        if value.startswith("/"):
            return self.local_path(service, value)
        return value

    def argv(self, service: str) -> list[str]:
        cmd = [self._localise(service, str(a)) for a in self.services[service]["command"]]
        if "--gpu" in cmd:
            i = cmd.index("--gpu")
            cmd[i:i + 2] = ["--device", "cpu"]
        if "--bind" in cmd:
            cmd[cmd.index("--bind") + 1] = "127.0.0.1"
        if "--port" in cmd:
            self.ports[service] = free_port()
            cmd[cmd.index("--port") + 1] = str(self.ports[service])
        return [str(HSX_BIN), *cmd]

    def env(self, service: str) -> dict[str, str]:
        env = {"PATH": f"{HSX_BIN.parent}:/usr/bin:/bin", "HOME": str(self.workdir / "home"), "LANG": "C.UTF-8",
               **thread_env()}
        for key, value in (self.services[service].get("environment") or {}).items():
            env[key] = self._localise(service, "" if value is None else str(value))
        return env

    # ---- processes ------------------------------------------------------------------------------
    def start(self, service: str) -> subprocess.Popen:
        log = self.workdir / f"{service}-{len(self.procs)}.log"
        proc = subprocess.Popen(self.argv(service), env=self.env(service), cwd=self.workdir / "home",
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.procs.append((service, proc, log))
        return proc

    def run_once(self, service: str, timeout: float = 120) -> str:
        proc = self.start(service)
        try:
            proc.wait(timeout=scaled(timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"{service} did not finish in {scaled(timeout):.0f}s\n{self.logs()}") from None
        assert proc.returncode == 0, f"{service} exited {proc.returncode}\n{self.logs()}"
        return self.procs[-1][2].read_text()

    def check_alive(self) -> None:
        for service, proc, _ in self.procs:
            if service not in ("producer", "demo_assets") and proc.poll() is not None:
                raise AssertionError(f"{service} (pid {proc.pid}) exited {proc.returncode}\n{self.logs()}")

    def stop(self, timeout: float = 60) -> dict[int, int]:
        """SIGTERM to everything still running (what `docker compose stop` sends); pid -> exit code."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        codes = {}
        for _, proc, _ in self.procs:
            try:
                codes[proc.pid] = proc.wait(timeout=scaled(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[proc.pid] = proc.wait()
        return codes

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"---- {service} (pid {proc.pid}) ----\n{log.read_text()[-tail:]}"
                         for service, proc, log in self.procs)


_PHASE_STARTED: list[float] = []


def phase(what: str, _started: list[float] = _PHASE_STARTED) -> None:
    """Print elapsed seconds at each step (shown with -s or on failure: where the time goes)."""
    _started or _started.append(time.monotonic())
    print(f"[{time.monotonic() - _started[0]:6.1f}s] {what}", flush=True)


def wait_for(predicate, timeout: float, what: str, cp: ComposeAsProcesses, interval: float = 0.05):
    """Poll for ``what``; ``timeout`` is a stall limit on a quiet machine, stretched on a loaded one."""
    return wait_until(what, predicate, timeout, interval=interval, check=cp.check_alive, describe=cp.logs)


def spooled(r, run: str) -> int:
    return r.zcard(RunKeys(run).spooled_log)


def finished(r, run: str) -> bool:
    p = run_progress(r, run)
    return p["complete"] and p["index_written"]


def batches_by_worker(r, run: str) -> dict[str, int]:
    """Worker name -> batches it extracted, from its last heartbeat (rq keeps no finished job: hsx.life's
    RESULT_TTL 0, issue 42). A batch may count twice (a lease that expired while its worker was stopped, run
    again by another worker)."""
    return {w["worker"]: w.get("batches", 0) for w in heartbeat.read_workers(r, run)}


def test_compose_run_adds_a_worker_mid_run(tmp_path, r, redis_server, s3_server, s3_bucket, tiny_model):
    run = "compose"
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(sample_dataset(), data / "conversations.jsonl")
    project = write_project(tmp_path / "project", {
        "HSX_HOST": "testbox", "HSX_RUN": run, "HSX_DATA_DIR": str(data), "HSX_DATASET": "/data/conversations.jsonl",
        "HSX_MODEL": "/models/tiny-qwen3", "HSX_LAYERS": "dflash:3", "HSX_DTYPE": "float32",
        "HSX_TOKEN_BUDGET": "1024", "HSX_MAX_LENGTH": "1024", "HSX_OVERLONG": "truncate",
        "HSX_STORE": f"s3://{s3_bucket}/hsx", "HSX_S3_ENDPOINT_URL": s3_server, "HSX_S3_ADDRESSING_STYLE": "path",
        # What a user puts in .env; compose hands it to the containers through env_file.
        "AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret",
    })
    cp = ComposeAsProcesses(compose_config(project, BASE), tmp_path / "run", redis_server.url)
    shutil.copytree(tiny_model, cp.local_path("producer", "/models/tiny-qwen3"))
    assert set(cp.services) >= {"redis", "producer", "gpu_worker_0", "gpu_worker_1", "uploader", "dashboard"}
    try:
        phase("producer")
        out = cp.run_once("producer")
        planned = int(r.hget(RunKeys(run).totals, "batches"))
        assert planned >= 20 and f"{planned} batches enqueued" in out, out
        dashboard = importlib.util.find_spec("dashboard.app") is not None
        if dashboard:
            cp.start("dashboard")
        for _ in range(2):  # docker compose up --scale uploader=2
            cp.start("uploader")
        phase("uploaders x2, gpu_worker_0")
        first = cp.start("gpu_worker_0")
        wait_for(lambda: spooled(r, run) >= 1, 90, "gpu_worker_0's first batch", cp)
        # Hold the first worker, so the run cannot end before the newcomer has loaded its model.
        os.kill(first.pid, signal.SIGSTOP)
        phase("gpu_worker_0 held; gpu_worker_1 joins")
        held_at = spooled(r, run)
        assert held_at < planned, "gpu_worker_0 finished the run before it could be held; plan more batches"
        second = cp.start("gpu_worker_1")  # docker compose up -d gpu_worker_1
        wait_for(lambda: spooled(r, run) > held_at, 90, "gpu_worker_1 to take a batch", cp)
        phase("gpu_worker_1 took a batch; gpu_worker_0 resumes")
        os.kill(first.pid, signal.SIGCONT)
        wait_for(lambda: finished(r, run), 120, "the run to complete", cp, interval=0.2)
        phase("run complete")
        if dashboard:
            url = f"http://127.0.0.1:{cp.ports['dashboard']}/rq"
            wait_for(lambda: urllib.request.urlopen(url, timeout=scaled(5)).status == 200, 30, url, cp, interval=0.5)
        # Re-running the producer is safe: same plan, nothing enqueued again.
        phase("producer again")
        again = cp.run_once("producer")
        assert f"0 batches enqueued, {planned} already done" in again, again
    finally:
        phase("stop")
        codes = cp.stop()
    logs = cp.logs()
    long_running = [proc for service, proc, _ in cp.procs if service not in ("producer",)]
    assert all(codes[p.pid] == 0 for p in long_running), f"{codes}\n{logs}"

    p = run_progress(r, run)
    assert p["complete"] and p["done"]["samples"] == 160 and not p["dead_letters"]
    assert p["done"]["batches"] == planned == len(ledger.done_ids(r, run))
    extracted = batches_by_worker(r, run)
    # Default worker names are <role>-<host>-<device>-<pid>-<random suffix>.
    by_pid = {pid: sum(n for name, n in extracted.items() if f"-{pid}-" in name) for pid in (first.pid, second.pid)}
    why = f"batches extracted per worker pid: {by_pid}; workers: {sorted(extracted.items())}\n{logs[-6000:]}"
    assert by_pid[first.pid] >= 1 and by_pid[second.pid] >= 1, why
    assert sum(by_pid.values()) == sum(extracted.values()) >= planned, why   # every batch was one of the two's
    # The spool was shared: the uploaders emptied what both workers wrote.
    assert not list(Path(cp.local_path("uploader", "/var/spool/hsx")).rglob("*.safetensors"))


def test_compose_cpu_override_runs_the_demo(tmp_path, r, redis_server):
    project = write_project(tmp_path / "project", {"HSX_HOST": "cpubox"})
    cp = ComposeAsProcesses(compose_config(project, BASE, CPU_OVERRIDE), tmp_path / "run", redis_server.url)
    assert not any(name.startswith("gpu_worker_") for name in cp.services)
    run = cp.services["producer"]["environment"]["HSX_RUN"]
    try:
        cp.run_once("demo_assets")
        cp.run_once("producer")
        worker = next(name for name, svc in cp.services.items() if role(svc) == "worker")
        cp.start(worker)
        cp.start("uploader")
        wait_for(lambda: finished(r, run), 120, "the demo run to complete", cp, interval=0.2)
    finally:
        codes = cp.stop()
    assert all(code == 0 for code in codes.values()), f"{codes}\n{cp.logs()}"
    p = run_progress(r, run)
    assert p["done"]["samples"] == 160 and not p["dead_letters"]
    store = Path(cp.local_path("producer", cp.services["producer"]["environment"]["HSX_STORE"])) / run
    assert (store / "manifest.json").is_file() and (store / "index.jsonl").is_file()
    assert len(list((store / "batches").rglob("*.safetensors"))) == p["done"]["batches"]
