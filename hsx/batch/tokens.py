"""The token columns' digests: what lets a reader that reads tokens by byte range check them.

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

from hsx.batch.dtypes import tensor_bytes

TOKEN_COLUMNS = ("cu_seqlens", "input_ids", "loss_mask")


def _sha256(parts: list[bytes | memoryview]):
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest


def token_digest(parts: list[bytes | memoryview]) -> str:
    """SHA-256 (hex) of the token columns' bytes (a batch's, or one sample's rows), in TOKEN_COLUMNS order."""
    return _sha256(parts).hexdigest()


def columns_digest(columns: dict[str, torch.Tensor]) -> str:
    """``token_sha256`` of a batch: the digest of its whole TOKEN_COLUMNS (CPU tensors), as the encoder writes it
    and a reader of the columns checks it."""
    return token_digest([tensor_bytes(columns[name]) for name in TOKEN_COLUMNS])


def sample_bounds(cu_seqlens: torch.Tensor, rows: int) -> list[int] | None:
    """``cu_seqlens`` as a list when it cuts ``rows`` rows into samples (int64 [B+1], from 0 to ``rows``, never
    decreasing); None otherwise: the file is then refused by its decoder whatever its header says (a writer
    validates its batch before it is encoded), so no per-sample digest is written for it."""
    if cu_seqlens.dtype != torch.int64 or cu_seqlens.ndim != 1:
        return None
    bounds = cu_seqlens.tolist()
    if not bounds or bounds[0] != 0 or bounds[-1] != rows or any(b < a for a, b in zip(bounds, bounds[1:], strict=False)):
        return None
    return bounds


def sample_token_digest(cu_rows: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    """One sample's digest from what a range read gives: its two cu_seqlens rows [2] int64, its input_ids [T]
    int32 and loss_mask [T] uint8 rows."""
    return token_digest([tensor_bytes(cu_rows), tensor_bytes(input_ids), tensor_bytes(loss_mask)])


def sample_token_digests(cu_seqlens: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> bytes | None:
    """Every sample's digest (32 bytes each, in row order); None when the columns do not form a batch."""
    if input_ids.dtype != torch.int32 or loss_mask.dtype != torch.uint8 or input_ids.ndim != 1 \
            or loss_mask.shape != input_ids.shape:
        return None
    bounds = sample_bounds(cu_seqlens, input_ids.shape[0])
    if bounds is None:
        return None
    cu, ids, mask = tensor_bytes(cu_seqlens), tensor_bytes(input_ids), tensor_bytes(loss_mask)
    return b"".join(_sha256([cu[8 * b:8 * b + 16], ids[4 * lo:4 * hi], mask[lo:hi]]).digest()
                    for b, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)))
