"""The drawing of the house holds: imports point only down (kernel <- roles, tools, reader <- CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every top-level package is a room (a new role's folder too, with no edit here), plus peers/.
ROOMS = tuple(sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")) + ("peers",)
ROLE = {"hsx"}  # a role (producer, gpu_worker, uploader, dashboard, any new folder) imports only the kernel
ALLOWED = {
    "hsx": set(),
    "hsx_reader": {"hsx"},
    "hsx_tools": {"hsx", "hsx_reader"},
    "hsx_cli": set(ROOMS) - {"hsx_cli", "peers"},
    "peers": {"hsx", "hsx_reader", "hsx_tools"},   # peers/hsx_peers: plugins for the peers' trainers, not in the wheel
}


def imported_rooms(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & set(ROOMS)


def test_imports_point_only_down():
    wrong = []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            for other in imported_rooms(path) - {room} - ALLOWED.get(room, ROLE):
                wrong.append(f"{path.relative_to(ROOT)} imports {other}")
    assert not wrong, "\n".join(wrong)


def test_the_rooms_are_found():
    assert {"hsx", "producer", "gpu_worker", "uploader", "dashboard", "hsx_tools", "hsx_reader", "hsx_cli"} < set(ROOMS)


def test_no_code_cites_a_design_file_outside_the_repo():
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            assert "DESIGN.md" not in path.read_text(), path


# The kernel's wings (issue 21): hsx/ is four sub-systems plus a few base modules. Each wall is a rule:
# the wing named on the left never imports the ones on the right (base modules are open to all).
WINGS = ("prep", "batch", "store", "run")
WALLS = {
    "prep": {"batch", "store", "run"},    # token preparation knows nothing of batch files, stores or Redis
    "batch": {"prep", "store", "run"},    # the format never imports run state (nor a store)
    "store": {"prep", "batch", "run"},    # a byte store never imports the format (nor torch: see below)
    "run": {"prep"},                      # run state may read the format and the store (rebuild, verify)
}
BASE = {"__init__", "config", "defaults", "devices", "digest", "errors", "fp8compute", "fp8linear", "layers", "localdirs",
        "manifest", "redisconn", "retry", "role", "spool", "visibility"}


def hsx_modules_imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hsx.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "hsx":
                found |= {f"hsx.{a.name}" for a in node.names}
            elif node.module.startswith("hsx."):
                found.add(node.module)
    return found


def test_the_wings_walls_hold():
    wrong = []
    for wing, forbidden in WALLS.items():
        for path in sorted((ROOT / "hsx" / wing).rglob("*.py")):
            for module in hsx_modules_imported(path):
                if module.split(".")[1] in forbidden:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module} (wall: {wing} never imports {module.split('.')[1]})")
    assert not wrong, "\n".join(wrong)


def test_no_flat_module_outside_the_base_list():
    flat = {p.stem for p in (ROOT / "hsx").glob("*.py")}
    assert flat == BASE, f"new flat modules {sorted(flat - BASE)} belong in a wing {WINGS}; gone: {sorted(BASE - flat)}"
    assert {p.name for p in (ROOT / "hsx").iterdir() if (p / "__init__.py").exists()} == set(WINGS)


def test_opening_a_store_does_not_import_torch():
    import subprocess
    import sys
    probe = "import sys, hsx.store, hsx.store.local, hsx.store.layout; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["False", "False"], out
