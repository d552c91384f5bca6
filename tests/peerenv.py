"""The peers' venvs (scripts/peers.sh, run by scripts/setup.sh --test) and running a script of tests/peers in one.

Shared by tests/test_peers.py (exports) and tests/test_zero_copy.py (a run read in place): a peer's process sees
this checkout (hsx, hsx_reader, hsx_tools) and its plugin package peers/hsx_peers on its path, nothing else of
this venv."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.threads import thread_env
from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
SCRIPTS = Path(__file__).resolve().parent / "peers"


def peer_python(name: str) -> Path:
    """The peer venv's python; without the venv, fail under CI (CI=true) and skip elsewhere."""
    python = PEERS / name / "bin" / "python"
    if not (PEERS / name / ".hsx-stamp").exists():
        message = f"no {name} venv in {PEERS}: run scripts/peers.sh (scripts/setup.sh --test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def peer_env(home: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    if home is not None:
        env["HOME"] = str(home)
    env.update(thread_env(), PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'peers'}", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    return env


def run_peer(name: str, script: str, *args, cwd: Path | None = None, seconds: float = 600) -> dict:
    """Run tests/peers/<script> in the peer's venv, within ``scaled(seconds)``; its last stdout line is a JSON report."""
    proc = subprocess.run([str(peer_python(name)), str(SCRIPTS / script), *map(str, args)], capture_output=True,
                          text=True, timeout=scaled(seconds), env=peer_env(), cwd=cwd)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
