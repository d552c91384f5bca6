"""Import every Python module that the installed `hsx` distribution put on disk (its RECORD).

Run by docker/install.sh in both image targets and by tests/test_wheel.py in a fresh venv: a
package or module left out of the wheel, or one that needs an undeclared dependency, fails here
rather than in a container at run time. Prints one line per failure and a count; exit 1 on any.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from importlib.metadata import distribution


def installed_modules(dist_name: str = "hsx") -> list[str]:
    names = set()
    for f in distribution(dist_name).files or ():
        parts = f.parts
        if f.suffix != ".py" or ".." in parts or parts[0].endswith((".dist-info", ".data")):
            continue
        mod = list(parts[:-1]) + ([] if f.stem == "__init__" else [f.stem])
        names.add(".".join(mod))
    return sorted(names)


def main() -> int:
    modules = installed_modules()
    failed = 0
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # report every broken module, not just the first
            failed += 1
            print(f"importcheck: {name}: {traceback.format_exc(limit=1).strip().splitlines()[-1]}", file=sys.stderr)
    packages = sorted({m.split(".")[0] for m in modules})
    print(f"importcheck: {len(modules) - failed}/{len(modules)} modules import; packages {' '.join(packages)}")
    return 1 if failed or not modules else 0


if __name__ == "__main__":
    sys.exit(main())
