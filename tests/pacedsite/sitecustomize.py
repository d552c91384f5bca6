"""On a test's PYTHONPATH, with HSX_TEST_MIN_BATCH_SECONDS > 0: every `hsx worker` a command starts as a child
(`hsx run`'s, which runs ``python -m hsx_cli.main worker``) loads tests/pacedworker.py's PacedExtractor.

Python imports ``sitecustomize`` at each interpreter's start; this one patches only processes started as a worker,
so the pacing stays the tests' (hsx has no such setting) and reaches children the test does not start itself.
"""

import importlib.util
import os
import sys
from pathlib import Path

if float(os.environ.get("HSX_TEST_MIN_BATCH_SECONDS") or 0) > 0 and "worker" in sys.argv[1:3]:
    spec = importlib.util.spec_from_file_location("pacedworker", Path(__file__).resolve().parents[1] / "pacedworker.py")
    paced = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paced)
    paced.install(float(os.environ["HSX_TEST_MIN_BATCH_SECONDS"]))
