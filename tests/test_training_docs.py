"""docs/training.md's commands run as written (issue 31, item 12; item 4's "from the checkout's parent").

Every fenced block right under a ``<!-- run by tests/test_training_docs.py -->`` line is taken from the page
and run unchanged, on the demo's run rebuilt small (16 shipped conversations, the tiny model, run ``demo`` in
``hsx-out``, its own Redis), from a folder that holds the demo's output and a checkout named ``hsx``: Python
blocks by this venv's python, shell blocks by bash with this venv's ``hsx`` on PATH.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.redisconn import LocalRedis
from hsx_tools.demo import sample_dataset
from tests.pipeline import run_pipeline
from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- run by tests/test_training_docs.py -->"


def runnable_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block directly under MARK."""
    return re.findall(re.escape(MARK) + r"\n```(\w+)\n(.*?)\n```", page.read_text(), re.S)


@pytest.fixture(scope="module")
def demo_folder(tiny_model, tmp_path_factory):
    """A user's folder after `hsx demo`: hsx-out/demo and a checkout named hsx beside it; no Redis in the
    environment (the demo's private one has stopped)."""
    root = tmp_path_factory.mktemp("docs")
    folder = root / "user"
    folder.mkdir()
    (folder / "hsx").symlink_to(ROOT, target_is_directory=True)
    data = root / "d.jsonl"
    data.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:16]))
    with LocalRedis(root / "redis") as redis:
        run_pipeline(redis.url, tiny_model, str(folder / "hsx-out"), root / "spool", run="demo", dataset=data)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.pop("HSX_REDIS_URL", None)
        env.pop("REDIS_URL", None)       # as after `hsx demo`: its Redis is gone, the store is enough
        env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
        yield folder, env


def test_the_page_marks_blocks_to_run():
    langs = [lang for lang, _ in runnable_blocks(ROOT / "docs" / "training.md")]
    assert langs.count("python") >= 1 and langs.count("sh") >= 1, langs


def test_python_blocks_run_as_written_and_the_stand_in_drafter_learns(demo_folder):
    folder, env = demo_folder
    blocks = [code for lang, code in runnable_blocks(ROOT / "docs" / "training.md") if lang == "python"]
    assert blocks
    for code in blocks:
        out = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                             timeout=scaled(300))
        assert out.returncode == 0, out.stderr[-3000:]
        losses = [float(x) for x in re.findall(r"epoch \d+ step \d+ loss ([\d.]+)", out.stdout)]
        assert len(losses) >= 4 and all(math.isfinite(x) for x in losses), out.stdout
        assert losses[-1] < losses[0], losses


def test_shell_blocks_run_as_written(demo_folder):
    folder, env = demo_folder
    blocks = [code for lang, code in runnable_blocks(ROOT / "docs" / "training.md") if lang == "sh"]
    assert blocks
    for code in blocks:
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=folder, env=env, capture_output=True,
                             text=True, timeout=scaled(300))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        assert "run demo: 16 samples" in out.stdout and "[[" in out.stdout and "non-finite" in out.stdout


def test_the_specforge_config_has_a_step_limit_and_the_peer_install_is_not_the_shared_venv():
    page = (ROOT / "docs" / "training.md").read_text()
    yaml_block = re.search(r"```yaml\n(model:.*?)```", page, re.S).group(1)
    import yaml

    config = yaml.safe_load(yaml_block)
    assert config["training"]["max_steps"] > 0
    assert "pip install hsx ./peers" not in page
    assert "trainer-venv/bin/pip install ./ ./peers" in page
