"""A fingerprint of a model's weights: two checkpoints of one config never pass for one run (issue 29 item 4).

The config hash says nothing of the weights, so another checkpoint of the same config was accepted as the same
run. Hashing a 54 GB checkpoint in full would take minutes; this reads a sample that any real difference
between two checkpoints shows in:

- every weight file's name and size;
- a safetensors file's whole header (tensor names, dtypes, shapes, offsets);
- of every tensor, ``WINDOW`` bytes at its start and ``WINDOW`` bytes at its middle;
- other weight files (``*.bin``, ``*.pt``): ``WINDOWS`` windows of ``WINDOW`` bytes spread evenly.

Reads headers + 2 x 1 KiB a tensor: for a 64-layer 27B checkpoint (~850 tensors, 54 GB) that is a few MB,
about 1,700 small reads (bench/weights_fingerprint.py). A checkpoint that differs from another only inside a
tensor, away from both windows (a few rows edited by hand), is not told apart: training changes every element
of the tensors it trains.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

from hsx.errors import HsxError

log = logging.getLogger(__name__)
SCHEME = "sampled-v1"   # prefix of every fingerprint: a later scheme is never compared as if it were this one
WINDOW = 1024           # bytes read at each sampled place
WINDOWS = 64            # sampled places in a weight file that is not safetensors
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MAX_SAFETENSORS_HEADER = 100 * 2**20  # bytes; safetensors' own limit


class WeightsUnreadable(HsxError, ValueError):
    """A weight file that cannot be fingerprinted (a corrupt safetensors header)."""


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


def weights_fingerprint(model: str) -> str:
    """``sampled-v1:<sha256>`` of the model's weight files, or "" when this host has none of them to read."""
    folder = local_folder(model)
    files = weight_files(folder) if folder is not None else []
    if not files:
        log.warning("model %s: no weight files on this host to fingerprint; the run's identity holds its config "
                    "hash only", model)
        return ""
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as fh:
            fd = fh.fileno()
            if path.name.endswith(".safetensors"):
                _sample_safetensors(fd, size, path, digest)
            else:
                for i in range(WINDOWS):
                    digest.update(os.pread(fd, WINDOW, max(size - WINDOW, 0) * i // max(WINDOWS - 1, 1)))
    return f"{SCHEME}:{digest.hexdigest()}"


def _sample_safetensors(fd: int, size: int, path: Path, digest) -> None:
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise WeightsUnreadable(f"{path}: {size} bytes, too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise WeightsUnreadable(f"{path}: safetensors header length {header_len} is implausible")
    raw = os.pread(fd, header_len, 8)
    digest.update(raw)
    try:
        header = json.loads(raw)
        spans = sorted((name, *t["data_offsets"]) for name, t in header.items() if name != "__metadata__")
    except (ValueError, TypeError, KeyError) as exc:
        raise WeightsUnreadable(f"{path}: not a safetensors header ({type(exc).__name__}: {exc})") from None
    base = 8 + header_len
    for _name, start, end in spans:
        length = min(WINDOW, max(end - start, 0))
        digest.update(os.pread(fd, length, base + start))
        digest.update(os.pread(fd, length, base + start + max(end - start - length, 0) // 2))
