"""A wing's face: the names its ``__init__.py`` imports from the wing's modules, where tools see them.

Each name is imported under its own name, the one it is defined under (grep and go-to-definition find it). A
module that imports nothing heavy is imported at the top of the face; one that imports torch, transformers,
boto3 or rq is imported under ``if TYPE_CHECKING:`` only, where type checkers and editors read it, and is loaded
on first use (PEP 562) by the ``__getattr__`` that ``face`` builds from that same block. So ``import hsx.life``
costs no rq (a peer's venv reading a run has none) and ``hsx.store`` stays free of torch. A module imported
whole (``from hsx.life import records``) is a namespace on the face. tests/test_house.py checks all of this.
"""

from __future__ import annotations

import ast
import importlib


def face(package: str, init_file: str):
    """(``__getattr__``, ``__dir__``, ``__all__``) for the wing ``package`` whose ``__init__.py`` is ``init_file``.

    The face's names: what the file imports from the wing's own modules (at the top or under ``TYPE_CHECKING``)
    and the public names it defines itself. A name imported under another name (``as``) is refused."""
    with open(init_file, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), init_file)
    lazy: dict[str, tuple[str, str | None]] = {}   # name -> (module, attribute or None for the module itself)
    eager: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                if isinstance(inner, ast.ImportFrom):
                    for name, where in _offered(package, inner).items():
                        lazy[name] = where
        elif isinstance(node, ast.ImportFrom):
            eager |= set(_offered(package, node))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            eager.add(node.name)
    if eager & set(lazy):
        raise ValueError(f"{package}: {sorted(eager & set(lazy))} offered twice (eager and on first use)")

    def __getattr__(name: str):
        if name not in lazy:
            raise AttributeError(f"module {package!r} offers no {name!r} (its face: {package}.__all__)")
        module, attribute = lazy[name]
        loaded = importlib.import_module(module)
        return loaded if attribute is None else getattr(loaded, attribute)   # read each time, as ``module.name``

    offered = sorted(eager | set(lazy))

    def __dir__():
        return offered

    return __getattr__, __dir__, offered


def _offered(package: str, node: ast.ImportFrom) -> dict[str, tuple[str, str | None]]:
    """name -> (module, attribute) for what ``from <module> import ...`` takes from ``package``'s own modules."""
    if node.level or not node.module or not (node.module == package or node.module.startswith(package + ".")):
        return {}
    found = {}
    for alias in node.names:
        if alias.asname and alias.asname != alias.name:
            raise ValueError(f"{package}: {alias.name!r} offered as {alias.asname!r}: a face offers a name as defined")
        found[alias.name] = (f"{package}.{alias.name}", None) if node.module == package else (node.module, alias.name)
    return found
