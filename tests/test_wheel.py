"""The built wheel, installed (not editable) into a fresh venv that cannot see the source tree, holds
every package and module of the project and runs: every module imports, `hsx --version` and `hsx demo`
work from that install. The same build inputs as the Docker images: the files `.dockerignore` lets in.

The fresh venv reuses this venv's third-party packages (torch & co.) through a .pth line, so nothing
is downloaded; a .pth line adds a plain folder (the .pth files inside it, such as the editable
install's hook to the source tree, are not run), and the test proves `hsx` resolves inside the venv.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

from tests.threads import thread_env
from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = {"tests", "bench", "scripts", "docs", "docker"}  # folders of the repo that are not packages of the wheel

pytestmark = pytest.mark.slow


def source_packages() -> set[str]:
    """Top-level packages of the source tree: folders with an __init__.py."""
    return {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in NOT_SHIPPED}


def dockerignore_allowed() -> set[str]:
    """Top-level names the build context keeps: `.dockerignore` is `*` then `!name` lines."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assert lines[0] == "*", ".dockerignore must start with `*` (an allow-list): see its header"
    return {ln[1:].split("/")[0] for ln in lines if ln.startswith("!")}


def build_context(dest: Path) -> Path:
    """A copy of what `docker build` sends: the allow-listed top-level names, minus caches."""
    for name in sorted(dockerignore_allowed()):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        elif src.exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def test_every_package_is_discovered_and_in_the_build_context():
    packages = source_packages()
    assert {"hsx", "hsx_cli", "hsx_tools", "hsx_reader", "producer", "gpu_worker", "uploader", "dashboard"} <= packages
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        assert any(fnmatch.fnmatch(pkg, pat) for pat in include), f"{pkg}: not in [tool.setuptools.packages.find] include"
        assert any(fnmatch.fnmatch(f"{pkg}.sub", pat) for pat in include), f"{pkg}.*: subpackages not included"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # transformers (>=4.56, what hsx installs) disables PyTorch below 2.6: a lower floor installs a broken pair.
    assert [d for d in deps if d.split(">")[0].split("=")[0].strip() == "torch"] == ["torch>=2.6"], deps
    missing = packages - dockerignore_allowed()
    assert not missing, f".dockerignore keeps {sorted(missing)} out of the image build context"


def test_wheel_installs_all_of_itself(tmp_path):
    # ---- build, from the same inputs as the Docker build context
    ctx = build_context(tmp_path / "ctx")
    dist = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(dist), str(ctx)], capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = dist.glob("hsx-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    shipped = {n.split("/")[0] for n in names if n.endswith(".py")}
    assert shipped == source_packages(), f"wheel has {sorted(shipped)}"
    # Every source module and package-data file of the tree is in the wheel.
    for pkg in source_packages():
        for f in (ROOT / pkg).rglob("*"):
            rel = f.relative_to(ROOT).as_posix()
            if f.is_file() and "__pycache__" not in rel and not rel.endswith(".pyc"):
                assert rel in names, f"{rel} is not in the wheel"

    # ---- a fresh venv that sees this venv's third-party packages but not the source tree
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=scaled(120))
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_reuse_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", **thread_env()}
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # ---- every module imports, from the installed copy
    where = subprocess.run([str(py), "-c", "import hsx, hsx_cli, dashboard; print(hsx.__file__, hsx_cli.__file__, dashboard.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=scaled(120))
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).is_relative_to(site), f"{path}: imported from outside the fresh venv"
    check = subprocess.run([str(py), str(ROOT / "docker" / "importcheck.py")], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=scaled(300))
    assert check.returncode == 0, check.stdout + check.stderr
    assert "packages " + " ".join(sorted(source_packages())) in check.stdout, check.stdout
    print(check.stdout.strip())

    # ---- the console script of the installed wheel
    hsx = venv / "bin" / "hsx"
    version = subprocess.run([str(hsx), "--version"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=scaled(120))
    assert version.returncode == 0 and "0.1.0" in version.stdout + version.stderr, version.stdout + version.stderr
    demo_env = dict(env, PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    demo_env.pop("HSX_REDIS_URL", None)
    demo = subprocess.run([str(hsx), "demo", "--store", str(tmp_path / "out"), "--workdir", str(tmp_path / "work"),
                           "--samples", "24"], capture_output=True, text=True, env=demo_env, cwd=tmp_path, timeout=scaled(600))
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert (tmp_path / "out" / "demo" / "index.jsonl").is_file() or list((tmp_path / "out").rglob("index.jsonl")), demo.stdout
