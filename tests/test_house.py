"""The drawing of the house holds: imports point only down (kernel <- roles, tools, reader <- CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("hsx", "producer", "gpu_worker", "uploader", "dashboard", "hsx_tools", "hsx_reader", "hsx_cli", "peers")
ALLOWED = {
    "hsx": set(),
    "producer": {"hsx"}, "gpu_worker": {"hsx"}, "uploader": {"hsx"}, "dashboard": {"hsx"},
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
            for other in imported_rooms(path) - {room} - ALLOWED[room]:
                wrong.append(f"{path.relative_to(ROOT)} imports {other}")
    assert not wrong, "\n".join(wrong)


def test_no_code_cites_a_design_file_outside_the_repo():
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            assert "DESIGN.md" not in path.read_text(), path
