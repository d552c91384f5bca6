"""The house in figures: the kernel's modules, wings, arrows and floors, and what each role imports of it.

    .venv/bin/python scripts/house_stats.py

An arrow is one kernel module importing another; an import of a wing's face counts one arrow to each private
module whose names the importer uses. A floor is a module's height over the modules it stands on (a module
importing nothing of the kernel is on floor 0). A circle is two or more modules importing each other, at import
time or inside a function. docs/architecture.md cites these figures. Everything is read from the source, nothing
imported but the faces (which import no torch): the script runs where torch is not installed.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ROLES = ("producer", "gpu_worker", "uploader", "dashboard", "hsx_tools", "hsx_reader", "hsx_cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


KERNEL = {module_name(p): p for p in (ROOT / "hsx").rglob("*.py")}
WINGS = sorted(m.split(".")[1] for m, p in KERNEL.items() if p.name == "__init__.py" and m != "hsx")


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(KERNEL[module].read_text())


def top_level(module: str):
    """The statements at the top of ``module``, those under ``if TYPE_CHECKING:`` too (a face's names on first use)."""
    for node in tree(module).body:
        yield from node.body if isinstance(node, ast.If) else (node,)


def provider(wing: str, name: str) -> str:
    """The private module behind ``name`` on ``wing``'s face: where the name's function or class is defined, a
    namespace's own module, or the face itself for a constant (no arrow)."""
    return defined_in(f"hsx.{wing}", name, f"hsx.{wing}")


def defined_in(module: str, name: str, face: str) -> str:
    """The module that defines ``name`` as found in ``module``, following imports of the kernel's modules."""
    if f"{module}.{name}" in KERNEL and name not in {n for s in top_level(module) for n in _defined(s)}:
        return f"{module}.{name}"                                      # a module offered as a namespace
    for node in top_level(module):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in KERNEL:
            for a in node.names:
                if (a.asname or a.name) == name:
                    return defined_in(node.module, a.name, face)
        elif name in _defined(node):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return module
            value = getattr(node, "value", None)                       # ``Alias = Name``: the name's module
            return defined_in(module, value.id, face) if isinstance(value, ast.Name) else face
    return face


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def kernel_imports(path: Path) -> set[str]:
    """Kernel modules ``path`` uses, faces resolved to the modules behind the names used."""
    text = path.read_text()
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "hsx":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                wing = node.module.split(".")[1] if node.module != "hsx" else a.name
                if node.module == "hsx" and a.name in WINGS:         # from hsx import life; life.Run(...)
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


def reach(edges: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for d in edges[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    return seen


def main() -> None:
    rooms = {m: p for m, p in KERNEL.items() if p.name != "__init__.py" and m != "hsx.face"}
    edges = {m: {d for d in kernel_imports(p) if d in rooms and d != m} for m, p in rooms.items()}
    floor: dict[str, int] = {}

    def height(m: str, seen: tuple = ()) -> int:
        if m not in floor:
            floor[m] = 1 + max((height(d, seen + (m,)) for d in edges[m] if d not in seen), default=-1)
        return floor[m]

    for m in rooms:
        height(m)
    circles = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in reach(edges, b)})
    print(f"kernel: {len(rooms)} modules in {len(WINGS)} wings + ground, {sum(map(len, edges.values()))} arrows, "
          f"{max(floor.values())} floors, {len(circles)} circles"
          + "".join(f"\n  circle: {a} <-> {b}" for a, b in circles))
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
