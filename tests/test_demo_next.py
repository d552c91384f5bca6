"""The demo ends pointing somewhere (issue 31, item 11): it prints the next commands, the one that reads a
sample runs as printed, and its run can be looked at after it ended (`hsx demo --look`: its Redis again, from
the data it kept)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.waiting import scaled

pytestmark = pytest.mark.slow


def hsx(*args, env=None, seconds=300):
    return subprocess.run([sys.executable, "-m", "hsx_cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=scaled(seconds))


def test_demo_prints_next_commands_and_its_run_can_be_looked_at_afterwards(tmp_path, tiny_model):
    env = {k: v for k, v in os.environ.items() if k not in ("HSX_REDIS_URL", "REDIS_URL")}   # its private Redis
    store, work = tmp_path / "out", tmp_path / "work"
    out = hsx("demo", "--samples", "8", "--store", str(store), "--workdir", str(work), env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    logs = {p.name: p.read_text() for p in (work / "logs" / "demo").glob("*.log")}   # the roles' output (launch.py)
    assert logs and not [name for name, text in logs.items() if "unexpected error" in text], logs  # 41 item 4
    lines = out.stdout.splitlines()
    nxt = lines.index("next:")
    steps = "\n".join(lines[nxt:])
    assert f"hsx demo --workdir {work.resolve()} --look" in steps and "hsx export --run demo" in steps
    show = next(line for line in lines[nxt:] if "read a sample:" in line).split(":", 1)[1].split("#  ")[0]
    argv = shlex.split(show.split("  #")[0])
    assert argv[:2] == ["hsx", "show"]
    shown = hsx(*argv[1:], env=env)
    assert shown.returncode == 0 and "in the loss mask" in shown.stdout, shown.stderr

    from hsx_tools.demo import look

    seen = {}

    def check(look_env):   # runs while the demo's Redis is up again, instead of the dashboard's foreground
        status = hsx("status", "--run", "demo", "--json", env=look_env)
        seen.update(json.loads(status.stdout))
        return 0

    assert look(work, serve=check) == 0
    assert seen["complete"] is True and seen["done"]["samples"] == 8
