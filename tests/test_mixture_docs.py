"""docs/data.md's mixture example runs as written: the shell block under ``<!-- run by tests/test_mixture_docs.py -->``
is run unchanged by bash, from a folder laid out as a checkout (its ``hsx_tools/data`` samples), with this venv's
``hsx`` on PATH and ``MODEL`` the tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- run by tests/test_mixture_docs.py -->"


def test_the_mixture_example_runs_as_written(tiny_model, tmp_path):
    blocks = re.findall(re.escape(MARK) + r"\n```(\w+)\n(.*?)\n```", (ROOT / "docs" / "data.md").read_text(), re.S)
    assert [lang for lang, _ in blocks] == ["sh"]
    (tmp_path / "hsx_tools").symlink_to(ROOT / "hsx_tools", target_is_directory=True)
    env = {**os.environ, "MODEL": str(tiny_model), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "HSX_TOKENISE_WORKERS": "1", "HSX_LAYERS": "dflash:3"}  # the tiny model: 6 layers
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", blocks[0][1]], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=scaled(180))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "source chat (sample_conversations.jsonl): 40 rows read, 40 kept, 0 rejected" in out.stdout, out.stdout
    assert "source agentic (sample_agentic.jsonl): 10 rows read, 10 kept, 0 rejected" in out.stdout, out.stdout
    assert out.stdout.count("  shared prefixes: ") == 2
