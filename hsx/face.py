"""A wing's face: the names it offers, each loaded from its private module on first use (PEP 562).

A wing's ``__init__.py`` says which module holds each public name; importing the wing imports none of them,
so ``from hsx.life import RunKeys`` costs the keys module alone, not rq's (a peer's venv reading a run has no
rq), and ``hsx.store`` stays free of torch. A name can be offered under another name (``{"read":
"recent_failures"}``), and a whole module as a namespace (``"layout": None`` under its own module name).
"""

from __future__ import annotations

import importlib


def face(package: str, offers: dict[str, list[str] | dict[str, str | None]]):
    """(``__getattr__``, ``__dir__``, ``__all__``) for the wing ``package``; ``offers``: module -> names it
    offers (a list), or -> {name in the module: name on the face} (a dict; None offers the module itself)."""
    where: dict[str, tuple[str, str | None]] = {}
    for module, names in offers.items():
        pairs = {n: n for n in names} if isinstance(names, list) else names
        for inner, public in pairs.items():
            public = public or inner
            if public in where:
                raise ValueError(f"{package}: {public!r} offered twice ({where[public][0]}, {module})")
            where[public] = (module, None if public == module and inner == module else inner)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} offers no {name!r} (its face: {package}.__all__)")
        module, inner = where[name]
        mod = importlib.import_module(f"{package}.{module}")
        return mod if inner is None else getattr(mod, inner)

    def __dir__():
        return sorted(where)

    return __getattr__, __dir__, sorted(where)
