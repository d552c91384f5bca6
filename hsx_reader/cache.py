"""A bounded cache of whole batch objects: least recently used first out, bounded by bytes.

In memory by default; with ``disk_dir`` the objects are kept as files there
instead (for a remote store and a local SSD), and read back with one
``readinto``. An object larger than the whole budget is returned, not kept.
Each DataLoader worker holds its own cache: the budget is per process.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_CACHE_BYTES = 2 * 2**30  # bytes a process keeps; sized for a few batch objects of a large model


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_held: int = 0      # bytes now held
    peak_bytes: int = 0      # most bytes ever held at once


class ByteCache:
    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES, disk_dir: Path | str | None = None):
        if max_bytes < 0:
            raise ValueError(f"cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
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
