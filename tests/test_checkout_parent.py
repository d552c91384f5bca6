"""`import hsx` from the folder that holds the checkout (issue 31, item 4).

The README puts a user beside the checkout (``../shared`` next to it). A checkout folder named ``hsx`` has no
``__init__.py``, so from its parent it is a namespace-package candidate named ``hsx``; the editable install must
still hand back the real package (with ``__version__``), and anything that imports through it must work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]


def test_import_hsx_from_the_parent_of_a_checkout_named_hsx(tmp_path):
    (tmp_path / "hsx").symlink_to(ROOT, target_is_directory=True)   # the checkout as the README lays it out
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import hsx, hsx.runspec.config, hsx_reader; from hsx import __version__; "
            "print(__version__, hsx.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, where = proc.stdout.split()
    assert version and Path(where).resolve() == (ROOT / "hsx" / "__init__.py").resolve()
