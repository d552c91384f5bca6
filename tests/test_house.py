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


# The kernel's wings (issues 21, 33): hsx/ is seven sub-systems on a ground of a few base modules. A wing may
# import only the wings below it (the ground is open to all and imports no wing); outside a wing, code sees
# only the wing's face, the names its __init__ lists in __all__.
GROUND = {"__init__", "defaults", "digest", "errors", "face", "layers", "localdirs", "pids", "printable", "redisconn",
          "retry"}
BELOW = {
    "prep": set(),                        # token preparation knows nothing of batch files, stores or Redis
    "batch": set(),                       # the batch-file format
    "store": set(),                       # bytes in a store (no torch: see below)
    "runspec": {"batch", "store"},        # what a run is: config, manifest, spool, visibility
    "life": {"runspec", "batch", "store"},            # a batch's and a run's life in Redis
    "fleet": {"life", "runspec", "batch", "store"},   # the processes serving runs
    "monitor": {"fleet", "life", "runspec", "batch", "store"},  # what status shows
}
WINGS = tuple(BELOW)
PRODUCT = [r for r in ROOMS if r != "hsx"] + ["hsx"]
SCRIPTS = "scripts"  # not a room (no package), but code that runs against a run: it keeps the rooms' rules on faces and keys


def wing_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    return parts[1] if parts[0] == "hsx" and len(parts) > 2 else None


def face(wing: str) -> set[str]:
    import importlib

    offered = getattr(importlib.import_module(f"hsx.{wing}"), "__all__", None)
    assert offered, f"hsx/{wing}/__init__.py declares no __all__"
    return set(offered)


def wing_imports(path: Path):
    """(line, wing, name-or-None, how) for every import of a wing in ``path``; how: face, deep, namespace."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "hsx" and len(parts) > 1 and parts[1] in WINGS:
                    yield node.lineno, parts[1], a.name, "deep" if len(parts) > 2 else "namespace"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if node.module == "hsx":
                for a in node.names:
                    if a.name in WINGS:
                        yield node.lineno, a.name, a.asname or a.name, "namespace"
            elif parts[0] == "hsx" and parts[1] in WINGS:
                for a in node.names:
                    yield node.lineno, parts[1], a.name, "deep" if len(parts) > 2 else "face"


def test_each_wing_imports_only_the_wings_below_it_and_the_ground_none():
    wrong = []
    for path in sorted((ROOT / "hsx").rglob("*.py")):
        mine = wing_of(path)
        allowed = set() if mine is None else BELOW[mine] | {mine}
        for line, wing, _, _ in wing_imports(path):
            if wing not in allowed:
                where = f"the ground ({path.stem})" if mine is None else f"wing {mine}"
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports wing {wing}: {where} may import {sorted(allowed) or 'no wing'}")
    assert not wrong, "\n".join(wrong)


def test_outside_a_wing_only_its_face_is_imported():
    """The one rule for every wing: from outside, import names of ``hsx.<wing>`` listed in its ``__all__``
    (or the wing itself, and use only such names of it); its modules are private to it. Tests and bench/ may
    reach inside (they measure and probe the private parts)."""
    faces = {w: face(w) for w in WINGS}
    wrong = []
    for room in [*PRODUCT, SCRIPTS]:
        for path in sorted((ROOT / room).rglob("*.py")):
            mine = wing_of(path)
            text = path.read_text()
            for line, wing, name, how in wing_imports(path):
                if wing == mine:
                    continue
                if how == "deep":
                    wrong.append(f"{path.relative_to(ROOT)}:{line} reaches inside wing {wing} (hsx.{wing} is its face)")
                elif how == "face" and name not in faces[wing]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name!r}, not on hsx.{wing}'s face")
                elif how == "namespace":
                    tree = ast.parse(text)
                    for n in ast.walk(tree):
                        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name \
                                and n.attr not in faces[wing]:
                            wrong.append(f"{path.relative_to(ROOT)}:{n.lineno} uses {name}.{n.attr}, not on hsx.{wing}'s face")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_every_name_on_a_face_is_there_and_a_face_loads_only_what_is_used():
    import subprocess
    import sys
    for wing in WINGS:
        probe = (f"import sys, hsx.{wing} as w; before = set(sys.modules); "
                 "missing = [n for n in w.__all__ if getattr(w, n, None) is None]; "
                 "print(missing, 'rq' in before, 'torch' in before)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
        assert out.split() == ["[]", "False", "False"], (wing, out)  # the face alone imports neither rq nor torch
    probe = ("import sys; " + "; ".join(f"import hsx.{w}" for w in WINGS)
             + "; print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'boto3', 'rq'}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["[]"], out   # every face at once: none of the heavy imports, eager modules included


def test_no_flat_module_outside_the_ground_list():
    flat = {p.stem for p in (ROOT / "hsx").glob("*.py")}
    assert flat == GROUND, f"new flat modules {sorted(flat - GROUND)} belong in a wing {WINGS}; gone: {sorted(GROUND - flat)}"
    assert {p.name for p in (ROOT / "hsx").iterdir() if (p / "__init__.py").exists()} == set(WINGS)


def test_opening_a_store_does_not_import_torch():
    import subprocess
    import sys
    probe = "import sys, hsx.store, hsx.store.local, hsx.store.layout; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["False", "False"], out


def test_every_rule_the_code_cites_is_written_in_the_architecture():
    import re
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rules = doc.split("## Rules", 1)[1].split("\n## ", 1)[0]
    written = {int(n) for n in re.findall(r"^\s*(\d+)\. ", rules, flags=re.M)}
    cited = []
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            for m in re.finditer(r"architecture\.md\)?,? rule (\d+)|DESIGN rule (\d+)", path.read_text()):
                cited.append((path.relative_to(ROOT), m.group(0), int(m.group(1) or m.group(2))))
    assert cited, "the code cites no rule: this test reads nothing"
    assert [c for c in cited if "DESIGN" in c[1] or c[2] not in written] == []


def test_the_architecture_lists_every_module_of_every_wing():
    import re
    doc = (ROOT / "docs" / "architecture.md").read_text()
    listed = {m.group(1): set(re.findall(r"`(\w+)`", m.group(2)))
              for m in re.finditer(r"^\| (\w+) \| (`.*`) \|$", doc, flags=re.M)}
    actual = {wing: {p.stem for p in (ROOT / "hsx" / wing).glob("*.py")} - {"__init__"} for wing in WINGS}
    actual["ground"] = GROUND - {"__init__"}
    assert listed == actual


# Outside the kernel a role says what it means (``run.exists()``, ``run.save_window(...)``), never which Redis key
# holds it: key names, and the commands on them, are the kernel's (issue 33 item 3), with no exception.
KEYS_OUTSIDE_THE_KERNEL: set[str] = set()


def test_outside_the_kernel_no_code_names_a_redis_key():
    found = set()
    for room in [*ROOMS, SCRIPTS]:
        if room == "hsx":
            continue
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.ImportFrom) else
                         [node.id] if isinstance(node, ast.Name) else
                         [node.attr] if isinstance(node, ast.Attribute) else [])
                if "RunKeys" in names:
                    found.add(str(path.relative_to(ROOT)))
    assert found == KEYS_OUTSIDE_THE_KERNEL, (
        f"RunKeys used outside hsx/ in {sorted(found - KEYS_OUTSIDE_THE_KERNEL)} (name what you read or write "
        f"as a function of its wing instead); no longer in {sorted(KEYS_OUTSIDE_THE_KERNEL - found)}")


# Faces that tools can see: a face offers each name under the name it is defined under (grep finds the definition)
# and imports it where type checkers and go-to-definition look: at the top of the face, or under TYPE_CHECKING when
# its module imports something heavy and is loaded on first use (hsx/face.py). Importing hsx patches nothing.
HEAVY = {"torch", "transformers", "boto3", "rq"}


def face_imports(wing: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(name -> module imported at the top or defined there, name -> module imported under TYPE_CHECKING, names
    imported under another name), read from hsx/<wing>/__init__.py."""
    package = f"hsx.{wing}"
    eager, typing_only, renamed = {}, {}, []

    def take(node, into):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(package):
            for a in node.names:
                if a.asname not in (None, a.name):
                    renamed.append(f"{package}: {a.name} as {a.asname}")
                into[a.asname or a.name] = f"{package}.{a.name}" if node.module == package else node.module
    for node in ast.parse((ROOT / "hsx" / wing / "__init__.py").read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                take(inner, typing_only)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            eager[node.name] = package
        else:
            take(node, eager)
    return eager, typing_only, renamed


def test_every_name_on_a_face_is_the_name_of_its_definition():
    import importlib
    import inspect

    wrong = []
    for wing in WINGS:
        offered = importlib.import_module(f"hsx.{wing}")
        for name in sorted(face(wing)):
            value = getattr(offered, name)
            if inspect.ismodule(value):
                assert value.__name__ == f"hsx.{wing}.{name}", (wing, name, value)   # a namespace: the module itself
            elif hasattr(value, "__name__") and value.__name__ != name:    # functions and classes; constants have none
                wrong.append(f"hsx.{wing}.{name} is {value.__module__}.{value.__name__}")
    assert not wrong, "offered under another name than its definition's:\n" + "\n".join(wrong)


def test_every_name_on_a_face_is_visible_to_static_analysis():
    """A type checker sees each name on a face: imported (or defined) at the top of the face, or imported under
    TYPE_CHECKING, and then the same object the face hands out at run time."""
    import importlib

    for wing in WINGS:
        eager, typing_only, renamed = face_imports(wing)
        assert not renamed, renamed
        assert face(wing) == set(eager) | set(typing_only), (wing, sorted(face(wing) ^ (set(eager) | set(typing_only))))
        offered = importlib.import_module(f"hsx.{wing}")
        for name, module in typing_only.items():
            defined = importlib.import_module(module)
            assert getattr(offered, name) is (defined if module.endswith(f".{name}") else getattr(defined, name)), name


def heavy_imports(module: str, seen: set[str]) -> set[str]:
    """The heavy packages that importing ``module`` (an hsx module) imports, through its top-level imports (not
    those under TYPE_CHECKING or inside functions) and the hsx modules and faces they import."""
    if module in seen:
        return set()
    seen.add(module)
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    found = set()
    parent = module.rsplit(".", 1)[0]
    if module.count(".") >= 1 and parent != "hsx":
        found |= heavy_imports(parent, seen)          # importing hsx.life.keys runs hsx/life/__init__.py first
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        for inner in ast.walk(node):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break
            names = ([(a.name, None) for a in inner.names] if isinstance(inner, ast.Import) else
                     [(inner.module, a.name) for a in inner.names]
                     if isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module else [])
            for imported, name in names:
                root = imported.split(".")[0]
                if root in HEAVY:
                    found.add(root)
                elif root == "hsx":
                    found |= heavy_imports(imported, seen) if imported != "hsx" else set()
                    wing = imported.split(".")[1] if imported.count(".") == 1 else None
                    target = f"{imported}.{name}"
                    if ROOT.joinpath(*target.split(".")).with_suffix(".py").exists() or (ROOT / "hsx" / str(name)).is_dir():
                        found |= heavy_imports(target if imported != "hsx" else f"hsx.{name}", seen)
                    elif wing in WINGS and name in face_imports(wing)[1]:
                        found |= heavy_imports(face_imports(wing)[1][name], seen)   # a name loaded on first use
    return found


def test_a_face_loads_on_first_use_only_what_imports_something_heavy():
    """Eager where nothing heavy is imported (torch, transformers, boto3, rq), TYPE_CHECKING + first use elsewhere."""
    wrong = []
    for wing in WINGS:
        eager, typing_only, _ = face_imports(wing)
        for module in sorted(set(eager.values()) - {f"hsx.{wing}"}):
            if heavy := heavy_imports(module, set()):
                wrong.append(f"hsx/{wing}/__init__.py imports {module} at its top: it imports {sorted(heavy)}")
        for module in sorted(set(typing_only.values())):
            if not heavy_imports(module, set()):
                wrong.append(f"hsx/{wing}/__init__.py loads {module} on first use: it imports nothing heavy, import it")
    assert not wrong, "\n".join(wrong)


def test_rq_loses_pickle_at_each_process_entry_not_on_an_import():
    """rq's default serializer is made JSON by the entry of each hsx process (the CLI, a role's serve, the
    dashboard's app), never by importing a module: what a process does is read where it starts."""
    import subprocess
    import sys
    entries = {("hsx_cli/main.py", "main"), ("hsx/fleet/role.py", "serve"), ("dashboard/app.py", "create_app")}
    calling, at_import = set(), []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                        isinstance(c, ast.Call) and ast.unparse(c.func).endswith("rq_without_pickle") for c in ast.walk(node)):
                    calling.add((str(path.relative_to(ROOT)), node.name))
            at_import += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in tree.body if isinstance(n, ast.Expr)
                          and isinstance(n.value, ast.Call) and ast.unparse(n.value.func).endswith("rq_without_pickle")]
    assert not at_import and entries <= calling, (at_import, sorted(entries - calling))
    probe = ("import rq.serializers as s; before = s.DefaultSerializer.loads; "
             "import hsx.life.queues, hsx.fleet.role, dashboard.app, hsx_cli.main; "
             "untouched = s.DefaultSerializer.loads is before; rc = hsx_cli.main.main(['status', '--no-such-flag']); "
             "print(untouched, rc, s.DefaultSerializer.loads is s.JSONSerializer.loads)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["True", "2", "True"], out


def test_a_missing_object_is_caught_as_the_store_s_typed_error():
    """A store read that finds no object raises hsx.store.ObjectNotFound (a KeyError); code around a store read
    catches that, not KeyError, which a bug in the same block (a dict lookup) raises too."""
    wrong = []
    for room in [*ROOMS, SCRIPTS]:
        for path in sorted((ROOT / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Try) or not any(
                        isinstance(c, ast.Call) and ast.unparse(c.func).split(".")[-1] in ("get_bytes", "read_header")
                        for stmt in node.body for c in ast.walk(stmt)):
                    continue
                for handler in node.handlers:
                    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                    if any(isinstance(t, ast.Name) and t.id == "KeyError" for t in caught):
                        wrong.append(f"{path.relative_to(ROOT)}:{handler.lineno}")
    assert not wrong, f"except KeyError around a store read (catch ObjectNotFound): {wrong}"


def test_product_code_cites_no_issue_numbers():
    """A comment keeps the why (what went wrong, what was measured); which issue it came from is git's history."""
    import re
    cited = [f"{path.relative_to(ROOT)}:{n}" for room in ROOMS if room != "peers"
             for path in sorted((ROOT / room).rglob("*")) if path.suffix in (".py", ".html", ".js", ".css")
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bissues? #?\d", line, re.I)]
    assert not cited, cited


def test_house_stats_runs_without_torch():
    """scripts/house_stats.py reads the house from the source: it runs where torch and transformers are not."""
    import subprocess
    import sys
    probe = ("import runpy, sys; sys.modules.update(torch=None, transformers=None); "
             "runpy.run_path('scripts/house_stats.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("kernel: ") and "RunKeys( outside hsx/: " in proc.stdout, proc.stdout


def test_life_offers_a_run_s_handle_not_verbs_that_take_the_run():
    """rq's pattern (``Queue(name, connection=r)``): what is done to one run is a method of ``life.Run(r, run)``,
    which carries the run's limits; the face offers no function that takes ``(r, run, ...)`` back, and every Redis
    record of a run is written inside hsx/ (the key rule above)."""
    import inspect

    from hsx import life

    takes_the_run = [name for name in life.__all__ if inspect.isfunction(getattr(life, name))
                     and list(inspect.signature(getattr(life, name)).parameters)[:2] == ["r", "run"]]
    assert takes_the_run == []
    run = life.Run(None, "r1", limits=None)
    assert run.name == "r1" and run.keys == life.RunKeys("r1")
    verbs = {"lease", "spool", "fail", "finish", "is_done", "spec", "manifest", "reap", "retry"}
    assert verbs <= set(dir(run)), sorted(verbs - set(dir(run)))
