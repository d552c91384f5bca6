"""`ruff check` over the whole tree (product, tests, bench, scripts) with the rules in pyproject.toml.

ruff is pinned in the test extra, so a new ruff release cannot turn CI red on its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = Path(sys.executable).with_name("ruff")
    assert ruff.exists(), f"ruff is not installed beside {sys.executable}: scripts/setup.sh --test installs it (pyproject [test])"
    proc = subprocess.run([str(ruff), "check", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
