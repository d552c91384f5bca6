"""The tests of code that leans on transformers' internals, run again against the GPU image's transformers.

CI installs a newer transformers than the H200 image has (5.17). Where an API moved between the two, the newer
one passes here while the device fails, and not always loudly: 5.17's decoder takes its cache as
``past_key_values`` and swallows an unknown ``cache=`` in ``**kwargs``, so every shared-prefix leaf was computed
without its prefix. scripts/compat.sh (run by scripts/setup.sh --test) puts transformers 5.17.0 in .compat/;
this runs the cache-continuing runner and the fused-kernel glue against it, in a subprocess with it first on
the path (the whole-run tests of test_prefix_reuse need Redis and are left to the main run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.threads import thread_env
from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
COMPAT = ROOT / ".compat" / "transformers-5.17"


def test_the_cache_and_kernel_glue_hold_on_the_gpu_images_transformers():
    if not (COMPAT / ".hsx-stamp").exists():
        message = f"no transformers 5.17 in {COMPAT}: run scripts/compat.sh (scripts/setup.sh --test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    env = {**os.environ, **thread_env(), "PYTHONPATH": os.pathsep.join([str(COMPAT), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_kernels.py",
         "tests/test_prefix_reuse.py", "-k", "not per_turn_run and not workers_check and not prefix_reuse_off "
         "and not resumed_run and not inspect_predicts",
         "-W", "ignore::DeprecationWarning"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(600))
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=env, capture_output=True, text=True, timeout=scaled(120)).stdout.strip()
    assert version == "5.17.0", f"the subprocess imported transformers {version!r}, not 5.17.0"
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"against transformers 5.17:\n{tail}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail
