"""A bounded cache of whole batch objects: least recently used first out, bounded by bytes.

In memory by default; with ``disk_dir`` the objects are kept as files there
instead (for a remote store and a local SSD), and read back with one
``readinto``. An object larger than the whole budget is returned, not kept.
Each DataLoader worker holds its own cache: the budget is per process, and on disk each process keeps
its objects in its own folder ``<cache_dir>/p<pid>`` (process_dir), removed when the process exits;
folders left by processes that died without cleaning up are removed by the next process that opens one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util
from pathlib import Path

import torch

DEFAULT_CACHE_BYTES = 2 * 2**30  # bytes a process keeps; sized for a few batch objects of a large model
OWNER_FILE = ".owner"            # in each p<pid> folder: held under an exclusive flock while its process lives


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_held: int = 0      # bytes now held
    peak_bytes: int = 0      # most bytes ever held at once


def _owned(folder: Path) -> int:
    """An open descriptor holding the exclusive lock on ``folder``'s owner file (created if absent)."""
    fd = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def _remove(folder: Path, fd: int) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path) -> list[Path]:
    """Remove the p<pid> folders under ``root`` whose process is gone (no one holds the owner lock; a folder
    without an owner file counts only once its pid is not alive: it may be one being created); return them."""
    removed = []
    for folder in root.glob("p*"):
        if not (folder.is_dir() and folder.name[1:].isdigit()) or int(folder.name[1:]) == os.getpid():
            continue
        if not (folder / OWNER_FILE).exists():
            if _pid_alive(int(folder.name[1:])):
                continue
            fd = None
        else:
            try:
                fd = _owned(folder)
            except OSError:      # held: its process lives
                continue
        shutil.rmtree(folder, ignore_errors=True)
        if fd is not None:
            os.close(fd)
        removed.append(folder)
    return removed


def process_dir(root: Path | str, owner: object) -> Path:
    """``root/p<pid>``, this process's cache folder: created and locked now, removed when ``owner`` is
    collected or the process exits (also a DataLoader worker: multiprocessing runs the finalizer there);
    stale folders of dead processes under ``root`` are removed first."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    folder = root / f"p{os.getpid()}"
    folder.mkdir(exist_ok=True)
    util.Finalize(owner, _remove, args=(folder, _owned(folder)), exitpriority=0)
    return folder


class ByteCache:
    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, disk_dir: Path | str | None = None,
                 process_root: Path | str | None = None):
        """``disk_dir``: keep objects there (left in place); ``process_root``: keep them in this process's own
        folder under it (process_dir: removed with the cache or at exit)."""
        if max_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        if process_root:
            disk_dir = process_dir(process_root, self)
        self.disk_dir = Path(disk_dir) if disk_dir else None
        if self.disk_dir:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self._entries: OrderedDict[str, tuple[int, torch.Tensor | Path]] = OrderedDict()
        self.stats = CacheStats()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str, load: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The object at ``key`` as a uint8 tensor: from the cache, else ``load(key)`` (then kept if it fits)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry[1] if isinstance(entry[1], torch.Tensor) else _read(entry[1], entry[0])
        self.stats.misses += 1
        buf = load(key)
        self._put(key, buf)
        return buf

    def _put(self, key: str, buf: torch.Tensor) -> None:
        size = buf.numel()
        if size > self.max_bytes:
            return
        while self._entries and self.stats.bytes_held + size > self.max_bytes:
            _, (old_size, old) = self._entries.popitem(last=False)
            if isinstance(old, Path):
                old.unlink(missing_ok=True)
            self.stats.bytes_held -= old_size
            self.stats.evictions += 1
        if self.disk_dir:
            path = self.disk_dir / hashlib.sha1(key.encode()).hexdigest()
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            with open(tmp, "wb") as fh:
                fh.write(memoryview(buf.numpy()))
            os.replace(tmp, path)
            self._entries[key] = (size, path)
        else:
            self._entries[key] = (size, buf)
        self.stats.bytes_held += size
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.bytes_held)

    def clear(self) -> None:
        for _size, entry in self._entries.values():
            if isinstance(entry, Path):
                entry.unlink(missing_ok=True)
        self._entries.clear()
        self.stats.bytes_held = 0


def _read(path: Path, size: int) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as fh:
        got = fh.readinto(memoryview(buf.numpy()))
    if got != size:
        raise OSError(f"{path}: cached object shrank to {got} of {size} bytes")
    return buf
