"""The house in figures: the kernel's modules, wings, arrows and floors, and what each role imports of it.

    .venv/bin/python scripts/house_stats.py

An arrow is one kernel module importing another; an import of a wing's face counts one arrow to each private
module whose names the importer uses. A floor is a module's height over the modules it stands on (a module
importing nothing of the kernel is on floor 0). docs/architecture.md cites these figures.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROLES = ("producer", "gpu_worker", "uploader", "dashboard", "hsx_tools", "hsx_reader", "hsx_cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


KERNEL = {module_name(p): p for p in (ROOT / "hsx").rglob("*.py")}
WINGS = sorted(m.split(".")[1] for m, p in KERNEL.items() if p.name == "__init__.py" and m != "hsx")


def provider(wing: str, name: str) -> str:
    """The private module behind ``name`` on ``wing``'s face."""
    value = getattr(importlib.import_module(f"hsx.{wing}"), name)
    mod = value.__name__ if hasattr(value, "__file__") else getattr(value, "__module__", f"hsx.{wing}")
    return mod if mod in KERNEL else f"hsx.{wing}"


def kernel_imports(path: Path) -> set[str]:
    """Kernel modules ``path`` uses, faces resolved to the modules behind the names used."""
    text = path.read_text()
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "hsx":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                wing = node.module.split(".")[1] if node.module != "hsx" else a.name
                if node.module == "hsx" and a.name in WINGS:         # from hsx import life; life.lease(...)
                    local = a.asname or a.name
                    used = set(re.findall(rf"(?<![\w.]){local}\.(\w+)", text))
                    found |= {provider(wing, n) for n in used}
                elif full in KERNEL:                                   # a module
                    found.add(full)
                elif node.module in KERNEL and KERNEL[node.module].name == "__init__.py" and node.module != "hsx":
                    found.add(provider(wing, a.name))                  # a name on a face
                elif node.module in KERNEL:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in KERNEL}
    return found - {"hsx"}


def import_units(path: Path) -> set[str]:
    """What ``path``'s import statements name in the kernel: a module, or a wing's face."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "hsx":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                units.add(full if full in KERNEL else node.module)
        elif isinstance(node, ast.Import):
            units |= {a.name for a in node.names if a.name in KERNEL}
    return units - {"hsx"}


def faces_and_ground(path: Path) -> set[str]:
    out = set()
    for m in kernel_imports(path):
        parts = m.split(".")
        out.add(f"hsx.{parts[1]}" if parts[1] in WINGS else m)
    return out


def main() -> None:
    rooms = {m: p for m, p in KERNEL.items() if p.name != "__init__.py" and m != "hsx.face"}
    edges = {m: {d for d in kernel_imports(p) if d in rooms and d != m} for m, p in rooms.items()}
    floor: dict[str, int] = {}

    def height(m: str, seen: tuple = ()) -> int:
        if m not in floor:
            floor[m] = 0 if not edges[m] else 1 + max(height(d, seen + (m,)) for d in edges[m] if d not in seen)
        return floor[m]

    for m in rooms:
        height(m)
    print(f"kernel: {len(rooms)} modules in {len(WINGS)} wings + ground, {sum(map(len, edges.values()))} arrows, "
          f"{max(floor.values())} floors")
    for wing in WINGS:
        inside = [m for m in rooms if m.startswith(f"hsx.{wing}.")]
        arrows = sum(len({d for d in edges[m] if d.startswith(f"hsx.{wing}.")}) for m in inside)
        offers = len(getattr(importlib.import_module(f"hsx.{wing}"), "__all__", ())) or "none"
        print(f"  {wing:8s} {len(inside):2d} modules, {arrows:2d} arrows inside, top floor "
              f"{max(floor[m] for m in inside)}, face offers {offers}")
    print("role/tool      imports name (modules or faces)  kernel modules used  most in one file")
    for role in ROLES:
        units, modules, worst = set(), set(), (0, "")
        for p in sorted((ROOT / role).rglob("*.py")):
            u = import_units(p)
            units |= u
            modules |= kernel_imports(p)
            worst = max(worst, (len(u), str(p.relative_to(ROOT))))
        print(f"  {role:12s} {len(units):4d}                             {len(modules):4d}                 "
              f"{worst[0]}: {worst[1]}")
    raw = sum(len(re.findall(r"RunKeys\(", p.read_text())) for r in ROLES + ("peers",) for p in (ROOT / r).rglob("*.py"))
    print(f"RunKeys( outside hsx/: {raw}")


if __name__ == "__main__":
    main()
