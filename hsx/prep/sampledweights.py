"""The weights fingerprint older hsx wrote (``sampled-v1``), kept so that the runs they planned still resume.

It read a sample: every weight file's name and size, a safetensors file's whole header, and of every tensor
``WINDOW`` bytes at its start and at its middle (other weight files: ``WINDOWS`` windows spread evenly). A
checkpoint changed elsewhere in a tensor (rows of added tokens, a hand patch) passed as the same model (issue
37 item 4): new runs record ``blake3-v1`` (hsx/prep/weights.py), and a run whose manifest holds a
``sampled-v1`` fingerprint is compared in that scheme, plus the full one its first worker records in Redis.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from hsx.errors import HsxError

SCHEME = "sampled-v1"
WINDOW = 1024           # bytes read at each sampled place
WINDOWS = 64            # sampled places in a weight file that is not safetensors
MAX_SAFETENSORS_HEADER = 100 * 2**20  # bytes; safetensors' own limit


class WeightsUnreadable(HsxError, ValueError):
    """A weight file that cannot be fingerprinted (a corrupt safetensors header)."""


def sampled_fingerprint(files: list[Path]) -> str:
    """``sampled-v1:<sha256>`` of these weight files (sorted by name), as older hsx computed it."""
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
