"""Roles refuse a Redis that may evict their keys (issue 23 item 6)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from hsx.fleet import evictionpolicy
from hsx.redisconn import LocalRedis, connect
from tests.waiting import scaled


@pytest.fixture
def lru_redis(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    try:
        connect(server.url).config_set("maxmemory-policy", "allkeys-lru")
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("role", [
    ["upload", "--spool-dir", "{spool}", "--burst"],
    ["worker", "--run", "r1", "--device", "cpu", "--spool-dir", "{spool}", "--burst"],
])
def test_roles_refuse_an_evicting_redis(lru_redis, tmp_path, role):
    args = [a.format(spool=tmp_path / "spool") for a in role]
    out = subprocess.run([sys.executable, "-m", "hsx_cli.main", *args], capture_output=True, text=True, timeout=scaled(120),
                         env={**os.environ, "HSX_REDIS_URL": lru_redis.url})
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "maxmemory-policy allkeys-lru" in lines[0] and "maxmemory-policy noeviction" in lines[0]


def test_produce_refuses_an_evicting_redis(lru_redis, tmp_path, tiny_model):
    from producer.produce import produce
    from tests.pipeline import produce_config

    with pytest.raises(evictionpolicy.EvictingRedis, match="noeviction"):
        produce(produce_config(lru_redis.url, tiny_model, str(tmp_path / "store")))
    assert not connect(lru_redis.url).exists("hsx:t1:plan")


def test_noeviction_passes_and_a_forbidden_config_warns_once(r, redis_server, caplog, monkeypatch):
    assert evictionpolicy.check_eviction_policy(r) == "noeviction"
    r.execute_command("ACL", "SETUSER", "noconfig", "on", ">pw", "~*", "&*", "+@all", "-config")
    try:
        limited = connect(redis_server.url.replace("redis://", "redis://noconfig:pw@"))
        monkeypatch.setattr(evictionpolicy, "_warned", False)
        with caplog.at_level(logging.WARNING, logger="hsx.fleet.evictionpolicy"):
            assert evictionpolicy.check_eviction_policy(limited) is None
            assert evictionpolicy.check_eviction_policy(limited) is None
        warnings = [rec for rec in caplog.records if "maxmemory-policy" in rec.getMessage()]
        assert len(warnings) == 1 and "noeviction" in warnings[0].getMessage()
    finally:
        r.execute_command("ACL", "DELUSER", "noconfig")


def test_a_role_stops_when_the_policy_turns_evicting_while_it_runs(tmp_path):
    """Checked only at start, a policy set mid-run let Redis evict 104 keys unnoticed. Each beat reads it:
    the role says so in one line and stops taking jobs (exit 2)."""
    from tests.test_role_skeleton import HSX_WITH_TALLY, ROOT
    from tests.waiting import wait_until

    server = LocalRedis(tmp_path / "redis").start()
    try:
        r = connect(server.url)
        proc = subprocess.Popen([sys.executable, "-c", HSX_WITH_TALLY, "tally", "--run", "toy", "--host", "h1",
                                 "--name", "tally-1", "--heartbeat-seconds", "0.3"], cwd=ROOT,
                                env={**os.environ, "HSX_REDIS_URL": server.url}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            wait_until("the tally's heartbeat", lambda: r.exists("hsx:toy:hb:tally-1"), 60,
                       check=lambda: proc.poll() is None)
            r.config_set("maxmemory-policy", "allkeys-lru")
            wait_until("the tally to stop", lambda: proc.poll() is not None, 60)
            _, err = proc.communicate(timeout=scaled(30))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 2, err
        said = [line for line in err.splitlines() if "maxmemory-policy allkeys-lru" in line]
        assert said and "noeviction" in said[-1] and "stops taking jobs" in err, err
        assert err.strip().splitlines()[-1].startswith("hsx tally: "), err     # the CLI's one-line refusal
    finally:
        server.stop()
