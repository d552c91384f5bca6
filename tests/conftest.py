"""Real parts for tests: a private redis-server (AOF on), moto's S3 server over HTTP (and rclone's and
SeaweedFS's, each started once a session), a tiny random Qwen3 model with a real tokenizer, and helpers to run roles in-process."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hsx.redisconn import LocalRedis, connect
from hsx_tools.demo import sample_dataset
from hsx_tools.tinymodel import build_tiny_model
from tests.test_reader_fixtures import dflash_run, eagle3_run  # noqa: F401 (fixtures shared by the reader and export tests)
from tests.threads import pin_threads

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


_REPORTS: list[str] = []   # what tests measured, for the run's summary (the controller's list under pytest-xdist)


def pytest_runtest_logreport(report):
    """Collect the ``report`` fixture's lines; under pytest-xdist this runs in the controller, on each worker's
    reports, so the lines reach the terminal either way (a worker's own prints do not)."""
    if report.when == "call":
        _REPORTS.extend(text for name, text in report.user_properties if name == "hsx report")


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("figures the tests measured")
        for text in _REPORTS:
            terminalreporter.write_line(text)


@pytest.fixture
def report(request):
    """``report(text)``: print ``text`` in the run's summary, whether the test passes or fails."""
    return lambda text: request.node.user_properties.append(("hsx report", text))


def pytest_configure(config):
    """One compute thread a test process (tests/threads.py): this one, and every subprocess through the environment."""
    pin_threads()


def _children() -> list[str]:
    """Ids of processes whose parent may be this one: its threads' /proc children lists (a few small reads, not a
    scan of every process), or every process where the kernel has no such lists (the caller checks the parent)."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        return [entry for entry in os.listdir("/proc") if entry.isdigit()]
    found = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as fh:
                found += fh.read().split()
        except OSError:   # a thread that ended meanwhile: its children went to another thread of this process
            continue
    return found


def _child_redis_pids() -> set[int]:
    """Live redis-server processes started by this test process (from /proc; zombies excluded)."""
    me, found = str(os.getpid()), set()
    for entry in _children():
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z" and b"redis-server" in cmdline:
            found.add(int(entry))
    return found


@pytest.fixture(autouse=True, scope="session")
def disk_spool_only():
    """Workers the tests start (in-process or as `hsx worker`) write to the disk tier only, unless a test asks for
    the memory tier: the default one (auto-sized at /dev/shm/hsx) would be shared by every test run on this host.
    tests/test_memory_spool_auto.py tests the default."""
    before = os.environ.get("HSX_MEMORY_SPOOL_BUDGET_GB")
    os.environ["HSX_MEMORY_SPOOL_BUDGET_GB"] = "0"
    yield
    if before is None:
        os.environ.pop("HSX_MEMORY_SPOOL_BUDGET_GB", None)
    else:
        os.environ["HSX_MEMORY_SPOOL_BUDGET_GB"] = before


@pytest.fixture(autouse=True)
def no_redis_server_left_behind():
    """A test that starts a redis-server stops it, whatever happens (fails the test otherwise)."""
    before = _child_redis_pids()
    yield
    left = _child_redis_pids() - before
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"the test left redis-server processes running: {sorted(left)}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.fail("redis-server is not installed (apt-get install redis-server); .ci/run installs it")
    server = LocalRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def r(redis_server):
    client = connect(redis_server.url)
    client.flushall()
    yield client
    client.flushall()


@pytest.fixture
def redis_env(redis_server, monkeypatch):
    monkeypatch.setenv("HSX_REDIS_URL", redis_server.url)
    return redis_server.url


def _test_credentials() -> None:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing-key-id")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing-secret")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on loopback: a real S3 protocol endpoint, driven through boto3."""
    from moto.server import ThreadedMotoServer

    _test_credentials()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # the port its own bind got: a port
    server.start()                                   # picked first could be taken before the bind (start then hangs)
    yield "http://{}:{}".format(*server.get_host_and_port())
    server.stop()


def _new_bucket(endpoint: str) -> str:
    import uuid

    import boto3

    name = f"hsx-test-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(s3_server):
    return _new_bucket(s3_server)


@pytest.fixture(scope="session")
def rclone_server(tmp_path_factory):
    """`rclone serve s3` (a real Go S3 server, tests/rclone.py) over a tmp folder: started once a session."""
    from tests.rclone import RcloneS3

    _test_credentials()
    where = tmp_path_factory.mktemp("rclone")
    server = RcloneS3(where / "root", where / "rclone.log").start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory):
    """`weed mini` (SeaweedFS, a real S3 server that verifies CRC32: tests/seaweedfs.py) over a tmp folder: started
    once a session, stopped and its data folder removed at the end."""
    from tests.seaweedfs import SeaweedS3

    _test_credentials()
    where = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedS3(where / "data", where / "weed.log").start()
    yield server.url
    server.stop()


S3_SERVERS = {"moto": "s3_server", "rclone": "rclone_server", "seaweedfs": "seaweedfs_server"}


@pytest.fixture(params=list(S3_SERVERS))
def s3_endpoint(request):
    """The endpoint URL of each S3 server the store suite runs against (parametrised: moto, rclone, seaweedfs)."""
    return request.getfixturevalue(S3_SERVERS[request.param])


@pytest.fixture
def s3_endpoint_bucket(s3_endpoint):
    return _new_bucket(s3_endpoint)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3", sample_path=sample_dataset())


@pytest.fixture(scope="session")
def tiny8_model(tmp_path_factory) -> Path:
    """The tiny model with 8 layers (eagle3's layers 1, 3 and 4 with a last layer after them), built once a session:
    read only (a test that writes beside the weights builds its own)."""
    return build_tiny_model(tmp_path_factory.mktemp("model8") / "tiny8", num_layers=8, sample_path=sample_dataset())


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory, tiny_model) -> Path:
    """The tiny model's config with other weights (another checkpoint of the same config): built once a session."""
    return build_tiny_model(tmp_path_factory.mktemp("model-b") / "tiny-qwen3", seed=1, sample_path=sample_dataset())


@pytest.fixture(scope="session")
def test_cache() -> Path:
    """Where expensive, deterministic fixtures (the sharp target) are kept between sessions and clones on this
    machine, each in a folder named by the code that builds it: ``HSX_TEST_CACHE``, else
    ``${XDG_CACHE_HOME:-~/.cache}/hsx/test-cache`` (beside scripts/peers.sh's venvs, which survive a fresh clone)."""
    where = os.environ.get("HSX_TEST_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hsx" / "test-cache"
    Path(where).mkdir(parents=True, exist_ok=True)
    return Path(where)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
