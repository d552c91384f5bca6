"""The token columns' digests: what lets a reader that reads tokens by byte range check them (issue 29 item 8).

A batch file's header carries, under the keys named in hsx/batch/meta.py:

- ``token_sha256``: SHA-256 of the batch's token columns, the bytes of ``cu_seqlens``, ``input_ids`` and
  ``loss_mask`` in that order (TOKEN_COLUMNS). Checked where a batch's token columns are read whole by range
  (the peers' token tables: hsx_reader/objects.py ``fetch_token_columns``). Both kinds of file have it.
- ``sample_token_sha256`` (batches of hidden states only): per sample b, SHA-256 of the bytes a range read of
  that sample's tokens fetches, in the same order: ``cu_seqlens[b:b + 2]`` (16 bytes), then its rows
  ``lo:hi`` of ``input_ids`` and of ``loss_mask``. Checked by ``RunDataset(fetch="range")`` on every sample it
  reads, with no byte read beyond the sample's own (hsx_reader/dataset.py). Its two cu_seqlens rows are in
  it, so a changed row boundary is caught as well as a changed token.
"""

from __future__ import annotations

import hashlib

import torch

TOKEN_COLUMNS = ("cu_seqlens", "input_ids", "loss_mask")


def token_digest(parts: list[bytes | memoryview]) -> str:
    """SHA-256 (hex) of the token columns' bytes (a batch's, or one sample's rows), in TOKEN_COLUMNS order."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def column_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes, as stored."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def sample_token_digest(cu_rows: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    """One sample's digest from what a range read gives: its two cu_seqlens rows [2] int64, its input_ids [T]
    int32 and loss_mask [T] uint8 rows."""
    return token_digest([column_bytes(cu_rows), column_bytes(input_ids), column_bytes(loss_mask)])


def sample_token_digests(cu_seqlens: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> list[str] | None:
    """Every sample's digest, in row order; None when the columns do not form a batch (the file is then refused
    by its decoder whatever its header says, and a writer validates its batch before this)."""
    if (cu_seqlens.dtype != torch.int64 or input_ids.dtype != torch.int32 or loss_mask.dtype != torch.uint8
            or cu_seqlens.ndim != 1 or input_ids.ndim != 1 or loss_mask.shape != input_ids.shape):
        return None
    bounds = cu_seqlens.tolist()
    n = input_ids.shape[0]
    if not bounds or bounds[0] != 0 or bounds[-1] != n or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
        return None
    cu, ids, mask = column_bytes(cu_seqlens), column_bytes(input_ids), column_bytes(loss_mask)
    return [token_digest([cu[8 * b:8 * b + 16], ids[4 * lo:4 * hi], mask[lo:hi]])
            for b, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))]
