"""`hsx` whose worker batches last a given wall time: for tests that must land a kill, a stop or an outage mid-batch.

The pacing is the tests', not the product's (hsx has no such setting). A test runs its roles as
``[*PACED_HSX, "worker", ...]`` (this file as a script: `python tests/pacedworker.py <hsx arguments>`; as
``$HSX_VENV/bin/hsx``: ``paced_venv``) with
HSX_TEST_MIN_BATCH_SECONDS in their environment (unset or 0: plain `hsx`); a command that starts its own workers
(`hsx run`) gets ``SITE`` on its PYTHONPATH too (tests/pacedsite/sitecustomize.py); an in-process test installs
``paced_extractor(seconds)`` as ``gpu_worker.worker.Extractor`` (monkeypatch). Either way the worker loads a
PacedExtractor: each batch's forward (``run``, ``run_shared``, ``run_shared_checked`` or ``run_measured``) is
stretched to that wall time, while the batch is leased and in hand and before it is spooled, as a slow model's is.
"""

from __future__ import annotations

import os
import sys
import time
from functools import wraps
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACED_HSX = [sys.executable, str(Path(__file__).resolve())]
ENV = "HSX_TEST_MIN_BATCH_SECONDS"
FORWARDS = ("run", "run_shared", "run_shared_checked", "run_measured")


def _stretched(forward):
    @wraps(forward)
    def paced(self, *args, **kwargs):
        if self.pacing:  # a forward inside another (run_measured runs run): the batch is stretched once
            return forward(self, *args, **kwargs)
        self.pacing, started = True, time.monotonic()
        try:
            out = forward(self, *args, **kwargs)
        finally:
            self.pacing = False
        time.sleep(max(0.0, self.min_batch_seconds - (time.monotonic() - started)))
        return out
    return paced


def paced_extractor(seconds: float):
    """gpu_worker's Extractor, each batch's forward taking at least ``seconds`` of wall time."""
    from gpu_worker.extractor import Extractor

    methods = {name: _stretched(getattr(Extractor, name)) for name in FORWARDS}
    return type("PacedExtractor", (Extractor,), {"min_batch_seconds": seconds, "pacing": False, **methods})


def paced_venv(folder: Path) -> Path:
    """A folder whose bin/hsx is this file (for scripts that run ``$HSX_VENV/bin/hsx``, as deploy/slurm's do)."""
    script = folder / "bin" / "hsx"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(f'#!/bin/sh\nexec "{PACED_HSX[0]}" "{PACED_HSX[1]}" "$@"\n')
    script.chmod(0o755)
    return folder


def install(seconds: float) -> None:
    """This process's worker loads a PacedExtractor (gpu_worker.worker.Extractor replaced)."""
    from gpu_worker import worker

    worker.Extractor = paced_extractor(seconds)


SITE = Path(__file__).resolve().parent / "pacedsite"   # on PYTHONPATH: workers a command starts as children are paced


def main(argv: list[str]) -> int:
    seconds = float(os.environ.get(ENV) or 0)
    if seconds > 0 and "worker" in argv[:2]:
        install(seconds)
    from hsx_cli.main import main as hsx

    return hsx(argv)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the checkout this file is in, not tests/ (whose modules would shadow others)
    sys.exit(main(sys.argv[1:]))
