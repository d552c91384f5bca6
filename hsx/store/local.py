"""A local-directory store (also any shared filesystem)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

from hsx.digest import file_sha256
from hsx.pids import gone_here
from hsx.store.base import ObjectInfo, ObjectNotFound, Store, VerifyError

TEMP_MARK = ".tmp-"   # a put's temp file: .<name>.tmp-<host>-<pid> (an older hsx: .<name>.tmp-<pid>)


def _temp_path(final: Path) -> Path:
    return final.with_name(f".{final.name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}")


def _writer_gone(tmp: Path) -> bool:
    """True where ``tmp`` names its writer as a process of this host that no longer runs (killed mid-put: the
    file is litter now). A writer of another host, or of an older hsx's name (no host), is not known: False."""
    host, _, pid = tmp.name.rpartition(TEMP_MARK)[2].rpartition("-")
    return pid.isdigit() and gone_here(host, int(pid))


class LocalStore(Store):
    def __init__(self, root: Path):
        """A missing ``root`` is created (checked first: one hsx cannot create is an UnwritableDir naming the fix)."""
        from hsx.localdirs import ensure_dir

        root = Path(root).expanduser()
        if not root.is_dir():
            ensure_dir(root, "store", "--store / HSX_STORE")
        self.root = root.resolve()

    def path(self, key: str) -> Path:
        """The file of ``key``; ValueError if it resolves (``..``, a symlink) outside the store root."""
        path = (self.root / key).resolve()
        if self.root not in path.parents and path != self.root:
            raise ValueError(f"key {key!r} escapes the store root {self.root}")
        return path

    def url(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def _commit(self, tmp: Path, final: Path) -> None:
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself must survive a crash
        finally:
            os.close(dir_fd)

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_path(final)
        try:
            tmp.write_bytes(data)
            self._commit(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return ObjectInfo(key, len(data), hashlib.sha256(data).hexdigest())

    def put_file(self, key: str, path: Path, size: int, sha256: str) -> ObjectInfo:
        """Copy (or, on the same filesystem, hard-link: no second write of the bytes) and verify."""
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_path(final)
        try:
            try:
                os.link(path, tmp)  # spool files are never modified in place (temp + rename)
            except OSError:
                shutil.copyfile(path, tmp)
            got_size, got_sha = tmp.stat().st_size, file_sha256(tmp)
            if (got_size, got_sha) != (size, sha256):
                raise VerifyError(f"{self.url(key)}: stored {got_size} bytes sha256 {got_sha[:12]}, "
                                  f"expected {size} bytes sha256 {sha256[:12]}")
            self._commit(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return ObjectInfo(key, size, sha256)

    def head(self, key: str) -> ObjectInfo | None:
        path = self.path(key)
        if not path.is_file():
            return None
        return ObjectInfo(key, path.stat().st_size, file_sha256(path))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self.path(key)
        if not path.is_file():
            raise ObjectNotFound(self.url(key))
        with open(path, "rb") as fh:
            if start:
                fh.seek(start)
            return fh.read() if end is None else fh.read(end - (start or 0))

    def list_keys(self, prefix: str) -> list[str]:
        base = self.path(prefix) if prefix else self.root
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith("."))

    def list_sizes(self, prefix: str) -> dict[str, int]:
        base = self.path(prefix) if prefix else self.root
        if not base.exists():
            return {}
        sizes = {}
        for p in base.rglob("*"):
            if not p.name.startswith("."):
                try:
                    if p.is_file():
                        sizes[str(p.relative_to(self.root))] = p.stat().st_size
                except FileNotFoundError:   # deleted while listed
                    continue
        return sizes

    def temp_files(self, prefix: str) -> list[tuple[Path, float]]:
        """Hidden ``.<name>.tmp-<host>-<pid>`` files under ``prefix`` (a writer killed mid-put, or one writing
        now) with their age in s."""
        import time

        base = self.path(prefix) if prefix else self.root
        if not base.exists():
            return []
        now = time.time()
        found = []
        for p in sorted(base.rglob(".*.tmp-*")):
            try:
                found.append((p, now - p.stat().st_mtime))
            except FileNotFoundError:  # committed or removed meanwhile
                pass
        return found

    def remove_temp_files(self, prefix: str, older_than: float | None = None) -> list[Path]:
        """Remove the temp files under ``prefix`` whose writer was a process of this host that no longer runs, and
        any at least ``older_than`` seconds old; the files removed. A live or unknown writer's fresh one is left."""
        removed = [tmp for tmp, age in self.temp_files(prefix)
                   if _writer_gone(tmp) or (older_than is not None and age >= older_than)]
        for tmp in removed:
            tmp.unlink(missing_ok=True)
        return removed

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def remove_empty_folders(self, prefix: str) -> None:
        """Temp files of killed writers under ``prefix`` (no object: list_keys hides them), then every folder
        left empty, ``prefix``'s own included, deepest first. A folder that still holds a file is kept."""
        base = self.path(prefix)
        if not base.is_dir():
            return
        for tmp, _ in self.temp_files(prefix):
            tmp.unlink(missing_ok=True)
        for folder in sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            if not any(folder.iterdir()):
                folder.rmdir()
        if not any(base.iterdir()):
            base.rmdir()
