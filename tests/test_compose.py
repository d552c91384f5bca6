"""docker-compose.yml and docker-compose.cpu.yml: valid, every command a real `hsx` sub-command,
volumes and environment that line up the way the roles need them.

The files are checked as `docker-compose config` resolves them (Debian's docker-compose v1: no
Docker engine needed), with `.env.example` as the `.env`. The helpers here are shared with
tests/test_compose_run.py, which runs the resolved services as processes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml

from hsx.redisconn import redact
from tests.threads import thread_env
from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
BASE = "docker-compose.yml"
CPU_OVERRIDE = "docker-compose.cpu.yml"
MOUNTED_FILES = ("docker/redis.conf", "docker/minio-init.sh")  # repo files the compose file bind-mounts
HSX_BIN = Path(sys.executable).with_name("hsx")
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN",
               "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD", "HSX_DASHBOARD_TOKEN", "HSX_DASHBOARD_PASSWORD",
               "HSX_REDIS_PASSWORD")
ODD_PASSWORD = "p/w@x:y#z"  # the characters that break a password inside a URL
MIN_WORKER_GRACE_SECONDS = 120  # a stopping worker may take HSX_GRACE_SECONDS (120 s) to write its last batch


# ---- helpers (also used by test_compose_run.py) -------------------------------------------------

def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def write_project(dest: Path, env: dict[str, str] | None = None) -> Path:
    """A copy of the compose files in ``dest`` with ``.env`` = ``.env.example`` updated by ``env``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (BASE, CPU_OVERRIDE, *MOUNTED_FILES):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, dest / name)
    values = read_env_file(ROOT / ".env.example")
    values.update(env or {})
    (dest / ".env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return dest


def docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if not exe:
        pytest.fail("docker-compose is not installed (apt-get install docker-compose; scripts/setup.sh --test does it)")
    return exe


def compose_config(project: Path, *files: str) -> dict:
    """The project as `docker-compose config` resolves it: files merged, ${...} and env_file filled in."""
    args = [docker_compose()]
    for name in files:
        args += ["-f", name]
    proc = subprocess.run(args + ["config"], cwd=project, capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0, f"docker-compose {' '.join(files)} config failed:\n{proc.stderr}"
    return yaml.safe_load(proc.stdout)


def active_services(config: dict, profiles: tuple[str, ...] = ()) -> dict[str, dict]:
    """Services `up` starts: those without a profile, or with one of ``profiles`` on."""
    return {name: svc for name, svc in config["services"].items()
            if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)}


def is_hsx(svc: dict) -> bool:
    return str(svc.get("image", "")).split("/")[-1].startswith("hsx:") or "build" in svc


def role(svc: dict) -> str | None:
    cmd = svc.get("command") or []
    return cmd[0] if is_hsx(svc) and cmd else None


def mounts(svc: dict) -> dict[str, str]:
    """container path -> source (named volume or host path), for a resolved service."""
    out = {}
    for spec in svc.get("volumes") or []:
        if isinstance(spec, dict):
            out[spec["target"]] = spec.get("source", "")
        else:
            source, target = spec.split(":")[:2]
            out[target] = source
    return out


def source_of(svc: dict, container_path: str) -> tuple[str, str] | None:
    """(mount target, source) of the mount holding ``container_path``, or None."""
    path = PurePosixPath(container_path)
    best = None
    for target, source in mounts(svc).items():
        if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
            if best is None or len(target) > len(best[0]):
                best = (target, source)
    return best


def size_bytes(value) -> int:
    """A compose byte size (2147483648, "2g", "512m") in bytes."""
    amount, unit = re.fullmatch(r"(\d+)([bkmg]?)b?", str(value).lower()).groups()
    return int(amount) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[unit]


def seconds(value) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    total = 0.0
    for amount, unit in re.findall(r"([\d.]+)(us|ms|s|m|h)", str(value)):
        total += float(amount) * {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
    return total


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_config(tmp_path_factory) -> dict:
    return compose_config(write_project(tmp_path_factory.mktemp("compose")), BASE)


@pytest.fixture(scope="module")
def cpu_config(tmp_path_factory) -> dict:
    return compose_config(write_project(tmp_path_factory.mktemp("compose-cpu")), BASE, CPU_OVERRIDE)


@pytest.fixture(params=["base", "cpu"])
def config(request, base_config, cpu_config) -> dict:
    return base_config if request.param == "base" else cpu_config


# ---- tests --------------------------------------------------------------------------------------

def test_compose_files_validate(tmp_path):
    project = write_project(tmp_path)
    for files in ((BASE,), (BASE, CPU_OVERRIDE)):
        args = [docker_compose()] + [a for f in files for a in ("-f", f)]
        for extra in (["config", "-q"], ["--profile", "minio", "config", "-q"]):
            proc = subprocess.run(args + extra, cwd=project, capture_output=True, text=True, timeout=scaled(60))
            assert proc.returncode == 0, f"{' '.join(files)} {' '.join(extra)}:\n{proc.stderr}"


def test_missing_host_name_is_refused(tmp_path):
    project = write_project(tmp_path, {"HSX_HOST": ""})
    proc = subprocess.run([docker_compose(), "config", "-q"], cwd=project, capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode != 0 and "HSX_HOST" in proc.stderr


def test_every_command_is_a_real_hsx_subcommand(base_config, cpu_config):
    from hsx_cli.main import build_parser

    parser = build_parser()
    commands = {tuple(svc["command"]) for cfg in (base_config, cpu_config)
                for svc in cfg["services"].values() if is_hsx(svc)}
    roles = {cmd[0] for cmd in commands}
    assert {"produce", "worker", "upload", "dashboard", "demo-assets"} <= roles
    for cmd in sorted(commands):
        parser.parse_args(list(cmd))  # every flag exists and parses (SystemExit otherwise)
    for name in sorted(roles):
        proc = subprocess.run([str(HSX_BIN), name, "--help"], capture_output=True, text=True, timeout=scaled(60))
        assert proc.returncode == 0, f"hsx {name} --help: {proc.stderr}"


def test_redis_is_durable_and_everyone_waits_for_it(config):
    redis = config["services"]["redis"]
    cmd = " ".join(redis["command"])
    for setting in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert setting in cmd
    assert "/data" in mounts(redis) and redis["healthcheck"]["test"]
    for name, svc in active_services(config).items():
        if role(svc) in ("produce", "worker", "upload", "dashboard"):
            assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_volumes_and_environment_line_up(config):
    services = active_services(config)
    hsx_services = {n: s for n, s in config["services"].items() if role(s) and role(s) != "demo-assets"}
    # One Redis URL everywhere, pointing at the redis service.
    urls = {s["environment"]["HSX_REDIS_URL"] for s in hsx_services.values()}
    assert len(urls) == 1
    url = urlsplit(urls.pop())
    assert url.hostname == "redis" and (url.port or 6379) == 6379
    # One host name for every worker and uploader of the box (upload@HOST).
    assert len({s["environment"]["HSX_HOST"] for s in hsx_services.values()}) == 1
    # Workers and uploaders share the spool volume at the same path (upload jobs carry that path).
    spool = {(s["environment"]["HSX_SPOOL_DIR"], source_of(s, s["environment"]["HSX_SPOOL_DIR"]))
             for s in hsx_services.values() if role(s) in ("worker", "upload")}
    assert len(spool) == 1, spool
    spool_dir, mount = spool.pop()
    assert mount is not None and mount[0] == spool_dir
    # ... and the memory tier: one tmpfs volume (not /dev/shm, which each container has its own of) at one path.
    memory = {(s["environment"]["HSX_MEMORY_SPOOL_DIR"], source_of(s, s["environment"]["HSX_MEMORY_SPOOL_DIR"]))
              for s in hsx_services.values() if role(s) in ("worker", "upload")}
    assert len(memory) == 1, memory
    memory_dir, mount = memory.pop()
    assert mount is not None and mount[0] == memory_dir and mount[1] != spool_dir
    volume = next(v for k, v in config["volumes"].items() if mount[1] in (k, v.get("name")))
    assert volume["driver_opts"]["type"] == "tmpfs" and re.fullmatch(r"size=\d+[kmg]?", volume["driver_opts"]["o"])
    # Workers get a /dev/shm above docker's 64 MiB default.
    for name, svc in hsx_services.items():
        if role(svc) == "worker":
            assert size_bytes(svc.get("shm_size", 0)) >= 2**30, (name, svc.get("shm_size"))
    # Producer and workers see the model at the same path (the manifest records it), HF cache inside.
    for name, svc in services.items():
        if role(svc) in ("produce", "worker"):
            env = svc["environment"]
            assert source_of(svc, env["HF_HOME"]) == source_of(services["producer"], env["HF_HOME"]), name
            model = services["producer"]["environment"]["HSX_MODEL"]
            if model.startswith("/"):
                assert source_of(svc, model) == source_of(services["producer"], model), name
    dataset = services["producer"]["environment"]["HSX_DATASET"]
    assert source_of(services["producer"], dataset), "the producer must mount the dataset's folder"
    # A local-directory store is the same volume for producer, workers and uploaders.
    store = services["producer"]["environment"]["HSX_STORE"]
    if not store.startswith("s3://"):
        # ... and the dashboard's, where `hsx verify` runs (docs/deploy.md).
        held = {source_of(s, store) for s in services.values()
                if role(s) in ("produce", "worker", "upload", "dashboard")}
        assert len(held) == 1 and None not in held


def test_one_gpu_worker_per_device(base_config):
    gpu = {n: s for n, s in base_config["services"].items() if n.startswith("gpu_worker_")}
    assert len(gpu) >= 2
    for name, svc in gpu.items():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [name.rsplit("_", 1)[1]] and "gpu" in device["capabilities"], name
        # The container sees only its reserved GPU, as cuda:0.
        assert svc["command"] == ["worker", "--gpu", "0", "--wait-for-plan"], name
        assert seconds(svc["stop_grace_period"]) > MIN_WORKER_GRACE_SECONDS, name
    assert seconds(base_config["services"]["uploader"]["stop_grace_period"]) >= 60
    assert base_config["services"]["producer"]["restart"] == "no"
    assert "deploy" not in base_config["services"]["uploader"]  # --scale uploader=N stays free


def test_cpu_override_needs_no_gpu(cpu_config, base_config):
    services = active_services(cpu_config)
    assert not any(s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
                   for s in services.values())
    gpu_in_base = {n for n in base_config["services"] if n.startswith("gpu_worker_")}
    assert not gpu_in_base & set(services), "every GPU worker of docker-compose.yml must be off in the CPU override"
    workers = [s for s in services.values() if role(s) == "worker"]
    assert workers and all(s["command"][1:] == ["--device", "cpu", "--wait-for-plan"] for s in workers)
    assert services["producer"]["depends_on"]["demo_assets"]["condition"] == "service_completed_successfully"


def test_dashboard_published_on_its_port(base_config):
    svc = base_config["services"]["dashboard"]
    port = svc["command"][svc["command"].index("--port") + 1]
    assert any(str(p).split(":")[-1].split("/")[0] == port for p in svc["ports"])
    assert svc["command"][svc["command"].index("--bind") + 1] == "0.0.0.0"  # reachable through the published port


def test_minio_is_optional(base_config):
    assert base_config["services"]["minio"]["profiles"] == ["minio"]
    assert "minio" not in active_services(base_config)


def test_no_credentials_in_commands_or_committed_files(base_config, cpu_config):
    example = read_env_file(ROOT / ".env.example")
    for key in SECRET_KEYS:
        assert not example.get(key), f".env.example must not hold a value for {key}"
    for cfg in (base_config, cpu_config):
        for name, svc in cfg["services"].items():
            for arg in (svc.get("command") or []) + (svc.get("entrypoint") or []):
                assert redact(str(arg)) == str(arg), f"{name}: a password on the command line"
                assert not re.search(r"(?i)(secret|password|access.key)", str(arg)), f"{name}: {arg}"
    raw = yaml.safe_load((ROOT / BASE).read_text())
    for name, svc in raw["services"].items():
        env = svc.get("environment") or {}
        assert not set(SECRET_KEYS) & set(env), f"{name}: credentials belong in the env_file, not in the compose file"


def test_default_worker_names_differ_between_containers(monkeypatch):
    from hsx_cli.common import worker_name

    # Two calls in one process stand for two containers of one service: same host name, same pid.
    assert worker_name("upload", "gpu-box-1") != worker_name("upload", "gpu-box-1")
    assert worker_name("gpu", "gpu-box-1", "cuda0") != worker_name("gpu", "gpu-box-1", "cuda0")


def test_every_worker_waits_for_the_plan(config):
    for name, svc in config["services"].items():
        if role(svc) == "worker":
            assert "--wait-for-plan" in svc["command"], f"{name} would exit 'not planned' on a fresh up"


def test_redis_reads_a_mounted_config_file(config):
    redis = config["services"]["redis"]
    conf = redis["command"][1]
    assert redis["command"][0] == "redis-server" and conf.endswith(".conf")
    mount = source_of(redis, conf)
    assert mount and mount[0] == conf, "the config path on redis-server's command line must be a mounted file"
    assert Path(mount[1]).is_file(), f"default config {mount[1]} is missing"


def _healthcheck_shell(redis_svc: dict, port: int) -> str:
    test = redis_svc["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL"
    # Compose turns $$ into $; the test's server listens on its own port instead of 6379.
    return test[1].replace("$$", "$").replace("redis-cli", f"redis-cli -p {port}")


def test_redis_healthcheck_passes_with_and_without_a_password(tmp_path):
    from hsx.redisconn import free_port

    plain = compose_config(write_project(tmp_path / "plain"), BASE)["services"]["redis"]
    secured = compose_config(write_project(tmp_path / "pw", {"HSX_REDIS_PASSWORD": ODD_PASSWORD}), BASE)["services"]["redis"]
    assert plain["environment"]["REDISCLI_AUTH"] == "" and secured["environment"]["REDISCLI_AUTH"] == ODD_PASSWORD
    assert ODD_PASSWORD not in " ".join(secured["healthcheck"]["test"]) + " ".join(secured["command"])

    def healthy(svc: dict, server_password: str | None) -> bool:
        port = free_port()
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        server = subprocess.Popen(args + (["--requirepass", server_password] if server_password else []),
                                  stdout=subprocess.DEVNULL, cwd=tmp_path)
        try:
            for _ in range(100):
                if subprocess.run(["redis-cli", "-p", str(port), "--no-auth-warning", "ping"], capture_output=True,
                                  text=True).stdout.strip() in ("PONG", "NOAUTH Authentication required."):
                    break
                time.sleep(0.05)
            env = {"PATH": "/usr/bin:/bin", **{k: str(v) for k, v in svc["environment"].items()}}
            return subprocess.run(["sh", "-c", _healthcheck_shell(svc, port)], env=env, timeout=scaled(30)).returncode == 0
        finally:
            server.terminate()
            server.wait(timeout=scaled(10))

    assert healthy(plain, None)
    assert healthy(secured, ODD_PASSWORD)
    assert not healthy(plain, ODD_PASSWORD), "a healthcheck without the password must not pass"


def test_redis_password_reaches_every_role_from_one_setting(tmp_path):
    """HSX_REDIS_PASSWORD (from .env) is added to a password-less HSX_REDIS_URL, URL-quoted."""
    from hsx.redisconn import free_port

    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--requirepass", ODD_PASSWORD], stdout=subprocess.DEVNULL, cwd=tmp_path)
    try:
        env = {"PATH": f"{HSX_BIN.parent}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
               "HSX_REDIS_URL": f"redis://127.0.0.1:{port}/0", **thread_env()}
        for _ in range(100):
            if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        without = subprocess.run([str(HSX_BIN), "status"], env=env, capture_output=True, text=True, timeout=scaled(120))
        assert without.returncode != 0 and "no runs" not in without.stdout, without.stdout + without.stderr
        ok = subprocess.run([str(HSX_BIN), "status"], env=dict(env, HSX_REDIS_PASSWORD=ODD_PASSWORD),
                            capture_output=True, text=True, timeout=scaled(120))
        assert "no runs in this Redis" in ok.stdout and not ok.stderr, ok.stdout + ok.stderr
        assert ODD_PASSWORD not in ok.stdout + ok.stderr
    finally:
        server.terminate()
        server.wait(timeout=scaled(10))


def test_minio_credentials_are_in_no_url(tmp_path):
    project = write_project(tmp_path, {"MINIO_ROOT_USER": "hsx-admin", "MINIO_ROOT_PASSWORD": ODD_PASSWORD})
    args = [docker_compose(), "--profile", "minio", "config"]
    proc = subprocess.run(args, cwd=project, capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr
    for name, svc in yaml.safe_load(proc.stdout)["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            value = str(value or "")
            assert not (ODD_PASSWORD in value and value != ODD_PASSWORD), f"{name}: {key} embeds the MinIO password"
            assert redact(value) == value, f"{name}: {key} is a URL with credentials"
    init = yaml.safe_load(proc.stdout)["services"]["minio_init"]
    script = source_of(init, init["entrypoint"][-1])
    assert script and Path(script[1]).is_file(), f"minio_init runs {init['entrypoint']}: not a mounted file"


def _stages() -> list[tuple[str, str]]:
    """(base, name) of each FROM line of the Dockerfile, in order."""
    out = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def test_dockerfile_cpu_target_needs_no_cuda_base_without_buildkit():
    """The classic builder builds every stage up to the target in file order."""
    stages = _stages()
    names = [name for _, name in stages]
    assert "cpu" in names and "gpu" in names
    before_cpu = stages[:names.index("cpu") + 1]
    assert not any("CUDA" in base for base, _ in before_cpu), f"stages built for --target cpu: {before_cpu}"


def test_dockerfile_torch_index_is_a_build_argument():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("RUN pip install") and "torch==" in ln]
    assert '--index-url "${TORCH_INDEX_URL}"' in line and "https://" not in line


def test_the_gpu_image_installs_the_gpu_extra_and_the_cpu_image_does_not():
    """The gpu target's workers run fla's kernels (packed rows, shared prefixes in waves): its deps layer installs
    pyproject's gpu extra, pinned, as install.sh reads it; the cpu target installs none of it."""
    import subprocess

    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM\s+", text, flags=re.M)
    runs = {re.match(r"\S+\s+AS\s+(\S+)", s, re.I).group(1): [ln for ln in s.splitlines() if "install.sh deps" in ln]
            for s in stages[1:] if re.match(r"\S+\s+AS\s+(cpu|gpu)\b", s, re.I)}
    assert runs["gpu"] and all(ln.rstrip().endswith("install.sh deps gpu") for ln in runs["gpu"]), runs
    assert runs["cpu"] and all(ln.rstrip().endswith("install.sh deps") for ln in runs["cpu"]), runs
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = subprocess.run(["sh", str(ROOT / "docker" / "install.sh"), "reqs", "gpu"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    assert listed == project["dependencies"] + project["optional-dependencies"]["gpu"]
    assert all("==" in req for req in project["optional-dependencies"]["gpu"])
    wrong = subprocess.run(["sh", str(ROOT / "docker" / "install.sh"), "reqs", "gpus"], capture_output=True, text=True)
    assert wrong.returncode != 0 and "no extra 'gpus'" in wrong.stderr
