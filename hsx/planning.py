"""Cutting samples into length-bucketed batches under a token budget.

Samples are sorted by length, longest first (an out-of-memory batch shows up
in the first minute, not the last hour), then cut greedily: a batch takes the
next sample while rows x padded_len <= token_budget, where padded_len is the
batch's longest sample rounded up to ``pad_multiple``. Sorting keeps padding
to the length spread inside a batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannedBatch:
    members: list[int]   # positions into the caller's sample list, longest first
    padded_len: int      # tokens a row, after rounding up
    tokens: int          # real tokens
    padded: int          # rows x padded_len: what the GPU computes


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def cut_batches(lengths: list[int], token_budget: int, max_rows: int, pad_multiple: int = 1) -> list[PlannedBatch]:
    if token_budget < 1 or max_rows < 1 or pad_multiple < 1:
        raise ValueError("token_budget, max_rows and pad_multiple must be positive")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[PlannedBatch] = []
    members: list[int] = []
    padded_len = tokens = 0
    for i in order:
        n = lengths[i]
        row_len = padded_len or round_up(n, pad_multiple)  # longest first: the first member sets it
        if round_up(n, pad_multiple) > token_budget:
            raise ValueError(f"a sample of {n} tokens exceeds the token budget {token_budget}")
        if members and ((len(members) + 1) * row_len > token_budget or len(members) >= max_rows):
            batches.append(PlannedBatch(members, padded_len, tokens, len(members) * padded_len))
            members, tokens, row_len = [], 0, round_up(n, pad_multiple)
        members.append(i)
        padded_len, tokens = row_len, tokens + n
    if members:
        batches.append(PlannedBatch(members, padded_len, tokens, len(members) * padded_len))
    return batches


def padding_fraction(batches: list[PlannedBatch]) -> float:
    padded = sum(b.padded for b in batches)
    return 1 - sum(b.tokens for b in batches) / padded if padded else 0.0
