"""A fingerprint of a model's weights: two checkpoints of one config never pass for one run.

``blake3-v1:<hex>``: BLAKE3 (the ``blake3`` package, pinned in pyproject.toml) of every weight file's name, size
and the BLAKE3 of all its bytes, files sorted by name. Every byte counts: a checkpoint changed anywhere in a
tensor (rows of added tokens, a hand patch) is another model. BLAKE3 is a cryptographic hash, so a checkpoint
cannot be crafted to match another's, and it hashes ~5 GB/s a core from the page cache (multithreaded over a
file's chunks); bench/weights_fingerprint.py measures it and extrapolates to the 27B checkpoint.

A worker fingerprints after it loaded the weights (the files are in the page cache then, so the hash costs less
than the load's read), the producer before it plans. Each file's hash is cached by its size, mtime and ctime
(``ctime`` cannot be set back by hand, so ``touch -r`` after a patch does not keep a stale entry), in
``.hsx-weights-fingerprint.json`` beside the checkpoint, or where that folder is not writable under the
user's cache dir (``$XDG_CACHE_HOME`` or ``~/.cache``, ``hsx/weights/``): a checkpoint is read in full once.

Runs planned by older hsx hold a ``sampled-v1`` fingerprint (hsx/prep/sampledweights.py): ``weights_fingerprint``
computes that scheme when asked, so they still resume and are compared as they were planned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import blake3

from hsx.errors import HsxError
from hsx.prep.sampledweights import SCHEME as SAMPLED_SCHEME
from hsx.prep.sampledweights import WeightsUnreadable, sampled_fingerprint

log = logging.getLogger(__name__)
WEIGHTS_SCHEME = "blake3-v1"    # prefix of every fingerprint: a fingerprint is only ever compared in its own scheme
SCHEMES = (WEIGHTS_SCHEME, SAMPLED_SCHEME)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CACHE_NAME = ".hsx-weights-fingerprint.json"   # beside the checkpoint: {"scheme", "files": {name: entry}}

__all__ = ["WEIGHTS_SCHEME", "SCHEMES", "UnknownScheme", "WeightsUnreadable", "fingerprint_cached", "local_folder",
           "scheme_of", "weight_files", "weights_fingerprint"]


class UnknownScheme(HsxError, ValueError):
    """A fingerprint of a scheme this hsx cannot compute (a newer hsx wrote it)."""


def scheme_of(fingerprint: str) -> str:
    """The scheme a fingerprint is in (its prefix); UnknownScheme if this hsx cannot compute it."""
    scheme = fingerprint.partition(":")[0]
    if scheme not in SCHEMES:
        raise UnknownScheme(f"weights fingerprint {fingerprint[:80]!r} is of scheme {scheme[:40]!r}, which this hsx "
                            f"cannot compute (it knows {', '.join(SCHEMES)}): use the hsx that planned the run")
    return scheme


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors if there are any, else the other kinds; sorted by name."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    safetensors = [p for p in files if p.name.endswith(".safetensors")]
    return safetensors or files


def local_folder(model: str) -> Path | None:
    """The folder holding the model's files on this host: the folder itself, or a hub id's cached snapshot."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # not cached here (or no such repo): nothing to read without the network
        return None


def weights_fingerprint(model: str, scheme: str | None = None) -> str:
    """``<scheme>:<hex>`` of the model's weight files (``WEIGHTS_SCHEME`` for None), or "" when this host has none of
    them to read; UnknownScheme for a scheme this hsx cannot compute."""
    folder = local_folder(model)
    files = weight_files(folder) if folder is not None else []
    if not files:
        return ""
    if scheme == SAMPLED_SCHEME:
        return sampled_fingerprint(files)
    if scheme not in (None, WEIGHTS_SCHEME):
        scheme_of(f"{scheme}:")  # raises UnknownScheme
    cache = FileHashCache(folder)
    digest = blake3.blake3()
    for path in files:
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{cache.file_hash(path, stat)}\0".encode())
    cache.save()
    return f"{WEIGHTS_SCHEME}:{digest.hexdigest()}"


def fingerprint_cached(model: str) -> bool:
    """Whether ``weights_fingerprint(model)`` reads nothing but the cache here (every weight file's entry is
    current): a worker then checks the weights before it loads them, and refuses another checkpoint at once."""
    folder = local_folder(model)
    files = weight_files(folder) if folder is not None else []
    cache = FileHashCache(folder) if files else None
    return bool(files) and all(cache.current(path, path.stat()) is not None for path in files)


def _stat_key(stat: os.stat_result) -> dict:
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


class FileHashCache:
    """Each weight file's BLAKE3, keyed by its name, size, mtime and ctime; read beside the checkpoint, else
    under the user's cache dir. A missing, stale or malformed cache is recomputed, never trusted."""

    def __init__(self, folder: Path):
        self.folder = folder.resolve()
        self.beside = self.folder / CACHE_NAME
        self.private = user_cache_dir() / f"{hashlib.sha256(str(self.folder).encode()).hexdigest()[:32]}.json"
        self.entries = self._read(self.beside) or self._read(self.private)
        self.changed = False

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            data = json.loads(path.read_bytes())
            files = data["files"] if data.get("scheme") == WEIGHTS_SCHEME else {}
            return {name: entry for name, entry in files.items()
                    if isinstance(entry, dict) and isinstance(entry.get("blake3"), str) and len(entry["blake3"]) == 64}
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return {}

    def current(self, path: Path, stat: os.stat_result) -> str | None:
        """The cached hash of ``path`` if its entry matches ``stat``, else None."""
        entry = self.entries.get(path.name)
        if entry is not None and {k: entry.get(k) for k in ("size", "mtime_ns", "ctime_ns")} == _stat_key(stat):
            return entry["blake3"]
        return None

    def file_hash(self, path: Path, stat: os.stat_result) -> str:
        cached = self.current(path, stat)
        if cached is not None:
            return cached
        started = time.perf_counter()
        hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
        if stat.st_size:
            hasher.update_mmap(str(path))
        seconds = time.perf_counter() - started
        log.info("fingerprinted %s: %.2f GB in %.1f s (%.2f GB/s, BLAKE3)", path, stat.st_size / 1e9, seconds,
                 stat.st_size / 1e9 / max(seconds, 1e-9))
        self.entries[path.name] = {**_stat_key(stat), "blake3": hasher.hexdigest()}
        self.changed = True
        return self.entries[path.name]["blake3"]

    def save(self) -> None:
        """Write the cache beside the checkpoint, or under the user's cache dir where the folder is read-only;
        a cache that cannot be written anywhere only costs the next call a full read."""
        if not self.changed:
            return
        raw = json.dumps({"scheme": WEIGHTS_SCHEME, "files": self.entries}, indent=1, sort_keys=True).encode()
        if not (_write_atomically(self.beside, raw) or _write_atomically(self.private, raw)):
            log.info("weights fingerprint of %s not cached (neither it nor %s is writable)", self.folder,
                     self.private.parent)


def _write_atomically(path: Path, raw: bytes) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".hsx-fp-")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.replace(tmp, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


def user_cache_dir() -> Path:
    """hsx's folder for weights fingerprints under the user's cache dir (XDG)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hsx" / "weights"
