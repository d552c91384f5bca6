"""`docker compose up` with a real Docker engine: the project's images built, the CPU override's
stack brought up, and the operations docs/deploy.md promises, in one stack lifetime:

  build (cold, then again: warm) -> up -> COMPLETE path on a dataset of ~100 batches:
  scale cpu_worker to 2 (the newcomer takes jobs) -> `docker kill` it mid-batch (the batch is
  reclaimed after its lease, no dead letter) -> a worker refusing a root-owned bind-mounted spool
  -> `down` (volumes kept) -> `up` again, now with a Redis password (redis.conf + HSX_REDIS_PASSWORD,
  the healthcheck authenticates) -> resumes, nothing redone -> COMPLETE -> `hsx verify` inside the
  stack -> the dashboard's / and /rq answer -> `down -v`, the test's image removed.

The engine and the two base images come from ../shared/docker/offline-base-images.sh (stand-ins
built from Debian packages: no image registry is reachable here); it starts dockerd when no engine
answers, and the test stops it again (--stop) when it was not running before.

Runs when CI=true (.ci/run sets it) and then fails if no engine can start; elsewhere only with
HSX_DOCKER_TESTS=1 (it builds images and runs a stack for minutes on a shared machine).
Timings are printed at the end (and on failure): image build cold/warm, up -> first batch,
up -> COMPLETE, scale-up -> first job, kill -> reclaim, down/up -> resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis as redis_lib

from hsx.life import ledger, queues
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress
from hsx.redisconn import free_port
from hsx_tools.demo import sample_dataset
from tests.test_compose import BASE, CPU_OVERRIDE, MOUNTED_FILES, ROOT, read_env_file
from tests.test_wheel import build_context
from tests.waiting import scaled, wait_until

pytestmark = pytest.mark.slow

RUN = "demo"  # the CPU override's run; the test only swaps in a longer dataset
PASSWORD = "p/w@x:y#z"  # characters that break a password written into a URL
IMAGE_UID = 10001
LEASE_SECONDS = 10
PACED_BATCH_SECONDS = 3  # until down/up: long enough for scale-up, a kill mid-batch and a reclaim before the run ends
TEST_OVERRIDE = "docker-compose.ci.yml"
PACED = ROOT / "tests" / "pacedworker.py"  # the worker's entrypoint in the test: batches paced, mid-batch kills land
REFUSED_SPOOL = "/var/spool/hsx-root-owned"  # the refused-spool step's bind target (apart from the service's spool volume)
SCRIPT_ENV = "HSX_OFFLINE_DOCKER_SCRIPT"
SCRIPT_REL = Path("shared/docker/offline-base-images.sh")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def offline_script() -> Path | None:
    """../shared/docker/offline-base-images.sh from the clone (CI), or above a worktree, or $HSX_OFFLINE_DOCKER_SCRIPT."""
    candidates = [Path(os.environ[SCRIPT_ENV])] if os.environ.get(SCRIPT_ENV) else []
    candidates += [parent / SCRIPT_REL for parent in ROOT.parents]
    return next((c for c in candidates if c.is_file()), None)


def data_dir() -> Path:
    return Path(os.environ.get("OFFLINE_DOCKER_DIR", "/var/tmp/offline-docker"))


def our_dockerd_running() -> bool:
    """Whether the dockerd that the script starts (pid file in its data dir) is alive."""
    try:
        pid = int((data_dir() / "dockerd.pid").read_text().split()[0])
        os.kill(pid, 0)
        return True
    except (OSError, ValueError, IndexError):
        return False


class Timings(dict):
    def line(self) -> str:
        return "compose timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.items())


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Environment (DOCKER_HOST, PATH, BuildKit) for docker/docker-compose against a live engine."""
    if not (in_ci() or os.environ.get("HSX_DOCKER_TESTS") == "1"):
        pytest.skip("a real Docker engine test (builds images, runs the stack for minutes): runs with CI=true "
                    "(.ci/run) or HSX_DOCKER_TESTS=1")
    script = offline_script()
    if script is None:
        pytest.fail(f"no {SCRIPT_REL} above {ROOT} (nor ${SCRIPT_ENV}): cannot start a Docker engine")
    was_running = our_dockerd_running()
    log = tmp_path_factory.mktemp("engine") / "offline-base-images.log"
    started = time.monotonic()
    with log.open("w") as err:
        proc = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, stderr=err, text=True, timeout=scaled(3000))
    if proc.returncode != 0:
        if not was_running and our_dockerd_running():
            subprocess.run(["bash", str(script), "--stop"], capture_output=True, timeout=scaled(120))
        pytest.fail(f"{script} exited {proc.returncode}: no engine or base images\n{log.read_text()[-4000:]}")
    env = dict(os.environ, COMPOSE_DOCKER_CLI_BUILD="1", DOCKER_BUILDKIT="1")
    for line in proc.stdout.splitlines():  # export NAME=VALUE lines, the only thing on its stdout
        m = re.fullmatch(r"\s*export\s+(\w+)=(.*)", line)
        if m:
            value = m.group(2).strip().strip('"').strip("'").replace("$PATH", env.get("PATH", ""))
            env[m.group(1)] = value
    version = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], env=env,
                             capture_output=True, text=True, timeout=scaled(60))
    assert version.returncode == 0, f"the engine does not answer: {version.stderr}"
    yield {"env": env, "engine_seconds": time.monotonic() - started, "server": version.stdout.strip()}
    if not was_running and our_dockerd_running():
        subprocess.run(["bash", str(script), "--stop"], capture_output=True, timeout=scaled(120))
        assert not our_dockerd_running(), "the dockerd this test started is still running"


# ---- a compose project of the test --------------------------------------------------------------

class Stack:
    def __init__(self, project: Path, name: str, env: dict[str, str]):
        self.project, self.name, self.env = project, name, env
        self.files = [BASE, CPU_OVERRIDE, TEST_OVERRIDE]

    def compose(self, *args: str, check: bool = True, seconds: float = 900) -> subprocess.CompletedProcess:
        cmd = ["docker-compose", "-p", self.name] + [a for f in self.files for a in ("-f", f)] + list(args)
        proc = subprocess.run(cmd, cwd=self.project, env=self.env, capture_output=True, text=True, timeout=scaled(seconds))
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[3:])} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-3000:]}\n{self.logs()}")
        return proc

    def docker(self, *args: str, seconds: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=scaled(seconds))

    def logs(self) -> str:
        cmd = ["docker-compose", "-p", self.name] + [a for f in self.files for a in ("-f", f)]
        proc = subprocess.run(cmd + ["logs", "--no-color", "--tail", "40"], cwd=self.project, env=self.env,
                              capture_output=True, text=True, timeout=scaled(120))
        return proc.stdout[-12000:]

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).stdout.split()

    def set_env(self, **values: str) -> None:
        env = read_env_file(self.project / ".env")
        env.update(values)
        (self.project / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))


def long_dataset(dest: Path, copies: int) -> Path:
    """The shipped conversations, ``copies`` times under new ids: about 50 batches a copy at budget 512."""
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines() if line.strip()]
    dest.mkdir(mode=0o755, parents=True)
    os.chmod(dest, 0o755)  # read by uid 10001 inside the producer (bind mount, read-only)
    out = dest / "long.jsonl"
    with out.open("w") as f:
        for c in range(copies):
            for row in rows:
                f.write(json.dumps(dict(row, id=f"{row['id']}-c{c}")) + "\n")
    os.chmod(out, 0o644)
    return out


def make_project(tmp_path: Path, image: str) -> tuple[Path, dict[str, int]]:
    project = build_context(tmp_path / "project")
    for name in ("Dockerfile", ".dockerignore", BASE, CPU_OVERRIDE, *MOUNTED_FILES):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, project / name)
    data = long_dataset(tmp_path / "data", copies=2)
    ports = {"redis": free_port(), "dashboard": free_port()}
    env = read_env_file(ROOT / ".env.example")
    env.update({
        "HSX_HOST": "cibox", "HSX_IMAGE": image, "HSX_DATA_DIR": str(data.parent),
        "HSX_REDIS_PUBLISH": f"127.0.0.1:{ports['redis']}", "HSX_DASHBOARD_PUBLISH": f"127.0.0.1:{ports['dashboard']}",
        # Paced batches and short leases, so that a kill lands mid-batch and the reclaim is quick.
        "HSX_TEST_MIN_BATCH_SECONDS": str(PACED_BATCH_SECONDS), "HSX_LEASE_SECONDS": str(LEASE_SECONDS), "HSX_HEARTBEAT_SECONDS": "2",
    })
    (project / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    shutil.copy(PACED, project / PACED.name)
    os.chmod(project / PACED.name, 0o644)  # read by uid 10001 inside the worker (bind mount, read-only)
    (project / TEST_OVERRIDE).write_text(
        "# The test's changes to the CPU override: a longer dataset and smaller batches; the worker's batches\n"
        "# paced by HSX_TEST_MIN_BATCH_SECONDS (tests/pacedworker.py: hsx has no such setting).\n"
        "services:\n"
        "  producer:\n"
        "    environment:\n"
        "      HSX_DATASET: /data/long.jsonl\n"
        "      HSX_TOKEN_BUDGET: \"512\"\n"
        "      HSX_MAX_LENGTH: \"512\"\n"
        "  cpu_worker:\n"
        f"    entrypoint: [\"python\", \"/opt/hsx-tests/{PACED.name}\"]\n"
        "    volumes:\n"
        f"      - ./{PACED.name}:/opt/hsx-tests/{PACED.name}:ro\n")
    return project, ports


# ---- Redis, seen from the host through the published port ----------------------------------------

def connect(port: int, password: str | None = None) -> redis_lib.Redis:
    return redis_lib.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=5)


def wait_for(predicate, timeout: float, what: str, stack: Stack, interval: float = 0.2, progress=None):
    """Poll for ``what``; ``timeout`` is a stall limit on a quiet machine, stretched on a loaded one and
    restarted while ``progress()`` changes. Redis restarting or the dashboard not up yet count as "not yet"."""
    return wait_until(what, predicate, timeout, interval=interval, progress=progress, describe=stack.logs,
                      retry_on=(redis_lib.ConnectionError, redis_lib.TimeoutError, redis_lib.ResponseError, OSError))


def done_count(r) -> int:
    return ledger.done_count(r, RUN)


def finished(r) -> bool:
    p = run_progress(r, RUN)
    return p["complete"] and p["index_written"]


def rq_workers_on(r, container_id: str) -> list[str]:
    """rq worker names registered from one container (rq records the host name: the container id).
    hsx uses the rq worker name as its own (heartbeat key)."""
    names = [n.decode() for n in r.smembers("rq:workers")]
    return [n.split("rq:worker:", 1)[-1] for n in names
            if (r.hget(n if n.startswith("rq:worker:") else f"rq:worker:{n}", "hostname") or b"").decode()
            == container_id[:12]]


def stats(r, worker: str) -> dict:
    """The worker's last heartbeat (hsx.life.heartbeat: current_batch, batches, ts, ...); {} before its first."""
    raw = r.get(RunKeys(RUN).heartbeat(worker))
    return json.loads(raw) if raw else {}


def took_a_job(r, worker: str) -> bool:
    st = stats(r, worker)
    return bool(st.get("current_batch") or st.get("batches"))


def fresh_batch_in_hand(r, worker: str, max_age: float = 1.0) -> str | None:
    """The batch the worker reported within ``max_age`` s as in hand, if it is not spooled yet."""
    st = stats(r, worker)
    bid = st.get("current_batch")
    if bid and time.time() - float(st.get("ts", 0)) < max_age and r.zscore(RunKeys(RUN).spooled_log, bid) is None:
        return bid
    return None


# ---- the test -----------------------------------------------------------------------------------

def test_compose_stack_on_a_real_engine(engine, tmp_path, report):
    t = Timings()
    image = f"hsx-ci-{uuid.uuid4().hex[:8]}"
    project, ports = make_project(tmp_path, image)
    stack = Stack(project, f"hsxci{uuid.uuid4().hex[:8]}", engine["env"])
    t["engine+base images"] = engine["engine_seconds"]
    try:
        _scenario(stack, ports, t, tmp_path)
    finally:
        report(f"{t.line()} (engine {engine['server']})")   # in the run's summary, passed or failed (conftest.report)
        stack.compose("down", "-v", "--remove-orphans", "-t", "30", check=False, seconds=600)
        stack.docker("rmi", "-f", f"{image}:cpu")
        left = stack.docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={stack.name}").stdout.split()
        vols = stack.docker("volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={stack.name}").stdout.split()
        assert not left and not vols, f"left behind: containers {left}, volumes {vols}"


def _scenario(stack: Stack, ports: dict[str, int], t: Timings, tmp_path: Path) -> None:
    # ---- images: cold (whatever the engine's cache holds), then warm (nothing changed)
    start = time.monotonic()
    stack.compose("build", "cpu_worker", seconds=1800)
    t["build cold"] = time.monotonic() - start
    start = time.monotonic()
    stack.compose("build", "cpu_worker")
    t["build warm"] = time.monotonic() - start
    image = read_env_file(stack.project / ".env")["HSX_IMAGE"]
    version = stack.docker("run", "--rm", f"{image}:cpu", "--version")
    assert version.returncode == 0 and "0.1.0" in version.stdout + version.stderr, version.stdout + version.stderr

    # ---- up: redis healthy, demo_assets, producer, one cpu_worker, uploader, dashboard
    up = time.monotonic()
    stack.compose("up", "-d", "--no-build")
    r = connect(ports["redis"])
    wait_for(lambda: done_count(r) >= 1, 300, "the first batch done", stack)
    t["up -> first batch"] = time.monotonic() - up
    totals = wait_for(lambda: (t := r.hgetall(RunKeys(RUN).totals)) and int(t.get(b"planning", 0)) == 0 and t,
                      300, "the plan to be complete (windowed planning)", stack)
    planned = int(totals[b"batches"])
    assert planned >= 60, f"{planned} batches: too few for the scenarios; raise the dataset copies"

    # ---- scale up: a second worker joins and takes jobs
    (first_worker,) = stack.containers("cpu_worker")
    scaled_up = time.monotonic()
    stack.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "cpu_worker=2", "cpu_worker")
    (newcomer,) = [c for c in stack.containers("cpu_worker") if c != first_worker]
    names = wait_for(lambda: rq_workers_on(r, newcomer), 120, "the new worker to register", stack)
    wait_for(lambda: any(took_a_job(r, n) for n in rq_workers_on(r, newcomer)), 120,
             "the new worker's first job", stack, interval=0.1)
    t["scale-up -> first job"] = time.monotonic() - scaled_up

    # ---- kill the newcomer mid-batch: its batch is reclaimed after its lease and finished by another
    victim_batch = wait_for(lambda: next((b for n in names if (b := fresh_batch_in_hand(r, n))), None),
                            90, "the new worker to hold a batch", stack, interval=0.05)
    kill = stack.docker("kill", newcomer)
    killed = time.monotonic()
    assert kill.returncode == 0, kill.stderr
    assert r.zscore(RunKeys(RUN).spooled_log, victim_batch) is None, "the batch was finished before the kill landed"
    wait_for(lambda: ledger.is_done(r, RUN, victim_batch), LEASE_SECONDS + 180, f"batch {victim_batch} reclaimed", stack)
    t["kill -> reclaimed batch done"] = time.monotonic() - killed
    assert not ledger.dead_letters(r, RUN)

    # ---- a bind-mounted spool the image user cannot write: the uploader refuses, with the fix.
    # The bind folder gets a target of its own and the spool setting points at it (`run -e`), so the
    # step does not depend on how a Compose version merges `run -v` with the service's own volume on
    # the same path (Debian's docker-compose 1.29.2-3 keeps the service's volume: the uploader then
    # starts on the shared spool and never exits).
    spool = tmp_path / "root-owned-spool"
    spool.mkdir(mode=0o755)
    assert spool.stat().st_uid != IMAGE_UID
    start = time.monotonic()
    refused = stack.compose("run", "--rm", "--no-deps", "-e", f"HSX_SPOOL_DIR={REFUSED_SPOOL}",
                            "-v", f"{spool}:{REFUSED_SPOOL}", "uploader", check=False, seconds=180)
    t["root-owned spool refused"] = time.monotonic() - start
    out = refused.stdout + refused.stderr
    assert refused.returncode == 2 and REFUSED_SPOOL in out and f"install -d -o {IMAGE_UID} {REFUSED_SPOOL}" in out, out[-3000:]

    # ---- down (volumes kept) mid-run, then up with a Redis password: resumes, nothing redone
    assert done_count(r) < planned - 5, "the run ended before down/up could be tested; raise the dataset copies"
    before = {m.decode(): s for m, s in r.zrange(RunKeys(RUN).spooled_log, 0, -1, withscores=True)}
    done_before = ledger.done_ids(r, RUN)
    r.close()
    stack.compose("down", "-t", "60")
    (stack.project / "redis.conf").write_text(f'requirepass "{PASSWORD}"\n')
    # After down/up the workers run unpaced: the rest of the run only has to finish.
    stack.set_env(HSX_REDIS_CONF="./redis.conf", HSX_REDIS_PASSWORD=PASSWORD, HSX_TEST_MIN_BATCH_SECONDS="0")
    resumed = time.monotonic()
    stack.compose("up", "-d", "--no-build")
    with pytest.raises(redis_lib.AuthenticationError):
        connect(ports["redis"]).ping()
    r = connect(ports["redis"], PASSWORD)
    wait_for(lambda: done_count(r) > len(done_before), 300, "the first batch after down/up", stack)
    t["down/up -> resume"] = time.monotonic() - resumed
    wait_for(lambda: finished(r), 300, "the run to complete", stack, interval=0.5, progress=lambda: done_count(r))
    t["up -> COMPLETE (with down/up)"] = time.monotonic() - up

    p = run_progress(r, RUN)
    assert p["done"]["batches"] == planned and not p["dead_letters"], p
    after = {m.decode(): s for m, s in r.zrange(RunKeys(RUN).spooled_log, 0, -1, withscores=True)}
    redone = sorted(b for b in done_before if after.get(b) != before.get(b))
    assert not redone, f"batches done before down were extracted again: {redone[:10]}"

    # ---- hsx verify inside the stack (the dashboard holds the `out` store volume)
    verify = stack.compose("exec", "-T", "dashboard", "hsx", "verify", check=False)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]
    secrets = stack.compose("exec", "-T", "dashboard", "hsx", "status", check=False)
    assert secrets.returncode == 0 and PASSWORD not in secrets.stdout + secrets.stderr + verify.stdout + verify.stderr

    # ---- the dashboard: its page and rq-dashboard's queue depths
    base = f"http://127.0.0.1:{ports['dashboard']}"
    page = wait_for(lambda: urllib.request.urlopen(f"{base}/", timeout=scaled(10)), 60, "the dashboard", stack)
    assert page.status == 200
    rq_page = urllib.request.urlopen(f"{base}/rq/", timeout=scaled(10))
    body = rq_page.read().decode(errors="replace")
    assert rq_page.status == 200
    assert PASSWORD not in body and quote(PASSWORD, safe="") not in body, "the Redis password is on /rq"
    depth = json.load(urllib.request.urlopen(f"{base}/rq/0/data/queues.json", timeout=scaled(10)))
    counts = {q["name"]: q["count"] for q in depth["queues"]}
    assert counts.get(queues.extract_queue_name(RUN)) == 0, counts
