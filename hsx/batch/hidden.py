"""The hidden-state rows' per-sample digests: what lets a range read check a sample's hidden states.

A batch file of hidden states whose tensors are stored raw (no codec) carries, under ``sample_hidden_crc32``
(hsx/batch/meta.py), per sample b the CRC-32 (zlib's) of the bytes a range read of that sample's hidden states
fetches: its rows ``lo:hi`` of each of HIDDEN_ROWS the file holds, in that order (the file's order):
``hidden_states``, then for FP8 ``hidden_scales``, then ``final_hidden_states`` and ``final_scales``. The
encoder computes it from the tensors it is about to write (``hsx.batch.batchfile.encode_header``, on the
worker's writer thread, from the host tensors already in memory: no copy); ``RunDataset(fetch="range")``
checks it on every sample it reads (hsx_reader/objects.py ``fetch_rows``). A file whose hidden states are
compressed has none: it is read whole and checked against the whole-object SHA-256.

Why CRC-32 and not SHA-256: this is a check against a store that changed bytes at rest (bit rot, a partial
rewrite, a bad copy), not against someone who means it: whoever can rewrite an object can rewrite its header,
digests included, so a cryptographic hash buys nothing here. The worker already SHA-256s the whole file as it
writes it; a second SHA-256 over every hidden byte would double that hashing, where zlib.crc32 costs a fraction
of it and releases the GIL on large buffers (docs/training.md has the figure per GiB). A changed byte, or any
burst of up to 32 changed bits, always changes a CRC-32; other changes are missed 1 time in 2^32.
"""

from __future__ import annotations

import zlib

import torch

from hsx.batch.dtypes import tensor_bytes
from hsx.batch.tokens import sample_bounds

HIDDEN_ROWS = ("hidden_states", "hidden_scales", "final_hidden_states", "final_scales")


def rows_crc32(parts: list[bytes | memoryview]) -> int:
    """CRC-32 of one sample's hidden-state rows' bytes, the parts in HIDDEN_ROWS order."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def sample_rows_crc32(rows: dict[str, torch.Tensor]) -> int:
    """One sample's CRC-32 from what a range read gives: its rows (as stored: FP8 not dequantised) of each of
    HIDDEN_ROWS the file holds."""
    return rows_crc32([tensor_bytes(rows[name]) for name in HIDDEN_ROWS if name in rows])


def sample_hidden_crcs(tensors: dict[str, torch.Tensor]) -> bytes | None:
    """Every sample's CRC-32 (4 bytes each, big-endian, in row order) of a batch's contiguous host tensors;
    None when the tensors do not form a batch of hidden states (no hidden_states, bad cu_seqlens, or a row
    tensor of another row count: such a file is refused by its decoder whatever its header says)."""
    cu_seqlens = tensors.get("cu_seqlens")
    if "hidden_states" not in tensors or cu_seqlens is None:
        return None
    present = [tensors[name] for name in HIDDEN_ROWS if name in tensors]
    n = present[0].shape[0] if present[0].ndim else -1
    bounds = sample_bounds(cu_seqlens, n)
    if bounds is None or any(t.ndim < 1 or t.shape[0] != n or t.device.type != "cpu" for t in present):
        return None
    views = [(tensor_bytes(t), t[0].numel() * t.element_size() if n else 0) for t in present]
    out = bytearray()
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out += rows_crc32([view[lo * row:hi * row] for view, row in views]).to_bytes(4, "big")
    return bytes(out)
