"""Collate functions: pack samples into one varlen row, or pad them into a [B, T_max] batch.

Both return int64 ``input_ids`` and ``position_ids``, the stored dtype for
hidden states, and ``loss_mask`` as uint8. Pass either to a DataLoader as
``collate_fn``; they run in the worker processes, where the large outputs are built straight in shared
memory (as torch's default collate does), so they reach the training process without another copy.
"""

from __future__ import annotations

import torch
from torch.utils.data import get_worker_info

HIDDEN_KEYS = ("hidden_states", "final_hidden_states")


def _empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor; in shared memory inside a DataLoader worker."""
    if get_worker_info() is None:
        return like.new_empty(shape)
    numel = 1
    for d in shape:
        numel *= d
    storage = like._typed_storage()._new_shared(numel, device=like.device)
    return like.new(storage).resize_(shape)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    out = _empty((sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:]), tensors[0])
    return torch.cat(tensors, out=out)


def collate_packed(samples: list[dict]) -> dict:
    """Concatenate samples into a single row of N = sum(T_b) tokens (no padding), for varlen attention.

    Returns ``input_ids`` [1, N] int64, ``loss_mask`` [1, N] uint8, ``position_ids`` [1, N] int64 (restarting
    at 0 for each sample), ``hidden_states`` [1, N, n*H] (and ``final_hidden_states`` [1, N, H] where stored),
    ``cu_seqlens`` [B+1] int32 (flash-attn's varlen convention), ``max_seqlen`` int, ``sample_ids``.
    """
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    starts = torch.repeat_interleave(cu[:-1].to(torch.int64), lengths)
    batch = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int64)[None],
        "loss_mask": torch.cat([s["loss_mask"] for s in samples])[None],
        "position_ids": (torch.arange(int(cu[-1]), dtype=torch.int64) - starts)[None],
        "cu_seqlens": cu,
        "max_seqlen": int(lengths.max()) if len(samples) else 0,
        "sample_ids": [s["sample_id"] for s in samples],
    }
    for key in HIDDEN_KEYS:
        if key in samples[0]:
            batch[key] = _cat([s[key] for s in samples])[None]
    _pass_cursor(samples, batch)
    return batch


def collate_padded(samples: list[dict], pad_token_id: int = 0, pad_to_multiple_of: int = 1) -> dict:
    """Right-pad samples to the longest (rounded up to ``pad_to_multiple_of``).

    Returns ``input_ids`` [B, T] int64 (``pad_token_id`` in padding), ``attention_mask`` [B, T] int64,
    ``loss_mask`` [B, T] uint8 (0 in padding), ``position_ids`` [B, T] int64, ``hidden_states`` [B, T, n*H]
    (zeros in padding; ``final_hidden_states`` likewise), ``lengths`` [B] int64, ``sample_ids``.
    """
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
    width = int(lengths.max()) if len(samples) else 0
    width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    B = len(samples)
    batch = {
        "input_ids": torch.full((B, width), pad_token_id, dtype=torch.int64),
        "attention_mask": torch.zeros((B, width), dtype=torch.int64),
        "loss_mask": torch.zeros((B, width), dtype=torch.uint8),
        "position_ids": torch.arange(width, dtype=torch.int64).repeat(B, 1),
        "lengths": lengths,
        "sample_ids": [s["sample_id"] for s in samples],
    }
    for key in HIDDEN_KEYS:
        if key in samples[0]:
            batch[key] = _empty((B, width, samples[0][key].shape[-1]), samples[0][key]).zero_()
    for b, s in enumerate(samples):
        t = int(lengths[b])
        batch["input_ids"][b, :t] = s["input_ids"]
        batch["attention_mask"][b, :t] = 1
        batch["loss_mask"][b, :t] = s["loss_mask"]
        for key in HIDDEN_KEYS:
            if key in batch:
                batch[key][b, :t] = s[key]
    _pass_cursor(samples, batch)
    return batch


def _pass_cursor(samples: list[dict], batch: dict) -> None:
    """A followed run's samples carry ``cursor`` (hsx_reader.follow): the batch keeps its last sample's."""
    if samples and "cursor" in samples[-1]:
        batch["cursor"] = samples[-1]["cursor"]
