"""A batch whose samples share prefixes (issue 40): each shared spine computed once, every sample stored whole.

A causal target's states at a token do not depend on what follows it, so samples that start with the same
``spine`` tokens need the spine computed once. A batch's plan (``BatchSpec.prefix_groups``, hsx/prep/prefixplan.py)
names groups of consecutive samples ``(first, count, spine)``; every other sample is computed alone, as before.
For a group:

1. the spine runs once (one row, no padding) with a transformers cache, in pieces of at most ``chunk_tokens``
   (a spine longer than a batch's budget is continued piece by piece, exactly): the cache then holds the
   attention layers' keys and values and the Gated DeltaNet layers' conv window and recurrent state at the
   branch point, wherever it falls (mid-chunk too: transformers' chunk rule starts from the cached state);
2. the cache is expanded to the members that go on (``reorder_cache`` with index 0 for each), and their
   remainders (the leaves) run in one forward, right-padded, at positions spine .. spine + leaf - 1: no mask
   is needed, a real token never sees the padding after it, and nothing reads the padded rows' final states;
3. every member's stored rows are the spine's rows followed by its leaf's (a member that is the spine itself,
   a strict prefix of the others, has no leaf).

Memory a group holds beyond a plain batch: the cache expanded to its leaves, ``leaves x spine`` tokens of keys
and values plus a conv window and a recurrent state a leaf and GDN layer; the planner caps ``leaves x spine``
(hsx/prep/prefixplan.py ``cache_tokens``) and the worker says the bound at start (``snapshot_bytes``).

The fused kernels (gpu_worker/kernels.py) keep their Gated DeltaNet forward for calls without a cache only: a
spine or a leaf (they carry a cache) runs transformers' GDN forward, the norms and MLPs stay fused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hsx.prep import PrefixGroup
from hsx.runspec import text_config


def _cache_for(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _position_ids(start: int, length: int, rows: int, device) -> torch.Tensor:
    return (torch.arange(start, start + length, device=device)).unsqueeze(0).expand(rows, -1)


def run_prefix_batch(extractor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, groups: Sequence[PrefixGroup],
                     chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stored tensors of a batch (packed ``input_ids`` [N], ``cu_seqlens`` [B + 1]) planned with ``groups``:
    (hidden [N, n*H], final [N, H] or None) on the extractor's device, in sample order, as ``Extractor.run``."""
    ex, device = extractor, extractor.device
    ids = input_ids.to(torch.int64)
    cu = [int(x) for x in cu_seqlens]
    n_tokens = cu[-1]
    hidden = torch.empty((n_tokens, ex.width), dtype=ex.out_dtype, device=device)
    final = (torch.empty((n_tokens, ex.hidden_size), dtype=ex.out_dtype, device=device) if ex.store_final else None)

    def put(dest: list[int], got: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        index = torch.tensor(dest, dtype=torch.int64, device=device)
        hidden.index_copy_(0, index, got[0])
        if final is not None:
            final.index_copy_(0, index, got[1])

    grouped = set()
    for g in groups:
        members = range(g.first, g.first + g.count)
        grouped.update(members)
        if any(cu[b + 1] - cu[b] < g.spine for b in members) or g.spine < 1:
            raise ValueError(f"prefix group {tuple(g)}: a member is shorter than its spine")
        if any(not torch.equal(ids[cu[b]:cu[b] + g.spine], ids[cu[g.first]:cu[g.first] + g.spine]) for b in members):
            raise ValueError(f"prefix group {tuple(g)}: its members do not share the spine's tokens")
        _run_group(ex, ids, cu, g, chunk_tokens, put)
    alone = [b for b in range(len(cu) - 1) if b not in grouped]
    if alone:
        _run_rows(ex, ids, cu, alone, 0, None, put)
    return hidden, final


def _run_group(ex, ids: torch.Tensor, cu: list[int], g: PrefixGroup, chunk_tokens: int, put) -> None:
    device = ex.device
    cache = _cache_for(ex.model)
    spine = ids[cu[g.first]:cu[g.first] + g.spine].to(device)
    members = range(g.first, g.first + g.count)
    for start in range(0, g.spine, max(1, chunk_tokens)):
        end = min(g.spine, start + chunk_tokens)
        got = ex.forward_packed(spine[start:end].unsqueeze(0), torch.arange(end - start, device=device), end - start,
                                cache=cache, use_cache=True, position_ids=_position_ids(start, end - start, 1, device))
        for b in members:   # every member's rows start with the spine's
            put(list(range(cu[b] + start, cu[b] + end)), got)
    leaves = [b for b in members if cu[b + 1] - cu[b] > g.spine]
    if leaves:
        cache.reorder_cache(torch.zeros(len(leaves), dtype=torch.int64, device=device))
        _run_rows(ex, ids, cu, leaves, g.spine, cache, put)


def _run_rows(ex, ids: torch.Tensor, cu: list[int], rows: list[int], skip: int, cache, put) -> None:
    """Rows ``rows``' tokens from ``skip`` on, right-padded in one forward (continuing ``cache`` if given)."""
    device = ex.device
    lengths = [cu[b + 1] - cu[b] - skip for b in rows]
    width = max(lengths)
    padded = torch.zeros((len(rows), width), dtype=torch.int64)   # padding: never seen by a real token
    flat, dest = [], []
    for r, b in enumerate(rows):
        padded[r, :lengths[r]] = ids[cu[b] + skip:cu[b + 1]]
        flat.extend(range(r * width, r * width + lengths[r]))
        dest.extend(range(cu[b] + skip, cu[b + 1]))
    kwargs = {}
    if cache is not None:
        kwargs = {"cache": cache, "use_cache": True, "position_ids": _position_ids(skip, width, len(rows), device)}
    got = ex.forward_packed(padded.to(device), torch.tensor(flat, dtype=torch.int64, device=device), len(dest),
                            **kwargs)
    put(dest, got)


def snapshot_bytes(model_config, cache_tokens: int, max_rows: int, dtype_bytes: int) -> int:
    """The most a batch's prefix groups hold beyond a plain batch: ``cache_tokens`` tokens of keys and values of
    every attention layer, and ``max_rows`` conv windows and recurrent states of every Gated DeltaNet layer."""
    c = text_config(model_config)
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    attention = sum(t != "linear_attention" for t in types)
    linear = len(types) - attention
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_key_value_heads * head_dim * attention * dtype_bytes * cache_tokens
    if not linear:
        return kv
    k, v = c.linear_key_head_dim, c.linear_value_head_dim
    conv_dim = 2 * c.linear_num_key_heads * k + c.linear_num_value_heads * v
    state = c.linear_num_value_heads * k * v * 4 + conv_dim * (c.linear_conv_kernel_dim - 1) * dtype_bytes
    return kv + linear * state * max_rows
