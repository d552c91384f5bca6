"""The SHA-256 of a file, read in chunks: what the store and the ledger check an object against."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: Path, chunk: int = 8 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
