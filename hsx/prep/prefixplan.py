"""Planning shared prefixes (issue 40): rows that start with the same tokens share one computed spine.

Rows of a window are sorted by their token ids; neighbours in that order share their longest common prefix
(lcp). A run of neighbours whose lcp is at least ``min_prefix`` tokens can be one group: its spine is the
run's smallest lcp, computed once, and each member computes only its remainder (its leaf). A run may instead be
split where its lcp is smallest into sub-runs with longer spines; the split is kept where it saves more tokens
((members - 1) x spine, summed): e.g. rows of one system prompt that are also turns of one conversation group
by conversation, their spine the whole shared history. Groups are one level deep: a leaf is computed from its
group's spine, never from another leaf.

A group becomes one or more ``PrefixGroup`` entries of batches: a batch's cost is what it computes (spine +
leaves x their padded length, for each group; rows x padded length for rows computed alone), at most the
token budget; ``leaves x spine`` (the cache expanded to the leaves: gpu_worker/prefixrun.py) at most
``cache_tokens``. A group too large for one batch is cut into several, each computing the spine again.
A batch holds groups only, or rows computed alone only (``cut_batches``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hsx.prep.planning import PlannedBatch, cut_batches, round_up

MAX_SPLIT_DEPTH = 200   # nested splits of one run tried at most (deeper: the run is kept as one group)


class PrefixGroup(NamedTuple):
    """Samples ``first`` .. ``first + count - 1`` of a batch start with the same ``spine`` tokens."""

    first: int
    count: int
    spine: int


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def find_groups(sequences, min_prefix: int) -> list[tuple[list[int], int]]:
    """Groups of ``sequences`` (token ids of each row) sharing at least ``min_prefix`` tokens:
    (positions into ``sequences``, spine tokens) each, spine = the members' longest common prefix."""
    seqs = [np.asarray(s, dtype=">u4") for s in sequences]   # big-endian: byte order = token order
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].tobytes())
    lcp = [0] + [_common(seqs[order[k - 1]], seqs[order[k]]) for k in range(1, len(order))]
    groups: list[tuple[list[int], int]] = []

    def best(lo: int, hi: int, depth: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Sorted positions lo..hi-1 (hi - lo >= 2, all lcp >= min_prefix inside): (saved, [(lo, hi, spine)])."""
        spine = min(lcp[lo + 1:hi])
        whole = ((hi - lo - 1) * spine, [(lo, hi, spine)])
        if depth >= MAX_SPLIT_DEPTH:
            return whole
        saved, parts, start = 0, [], lo
        for k in [k for k in range(lo + 1, hi) if lcp[k] == spine] + [hi]:
            if k - start >= 2:
                s, p = best(start, k, depth + 1)
                saved, parts = saved + s, parts + p
            start = k
        return (saved, parts) if saved > whole[0] else whole

    start = 0
    for k in range(1, len(order) + 1):
        if k == len(order) or lcp[k] < min_prefix:
            if k - start >= 2:
                for lo, hi, spine in best(start, k, 0)[1]:
                    groups.append((sorted(order[lo:hi]), spine))
            start = k
    return groups


def _chunks(members: list[int], lengths, spine: int, token_budget: int, max_rows: int, pad_multiple: int,
            cache_tokens: int) -> list[tuple[list[int], int]]:
    """A group cut into pieces that each fit a batch: (members, computed tokens) each; longest leaf first."""
    members = sorted(members, key=lambda i: -lengths[i])
    out, piece = [], []
    for i in members + [None]:
        if i is not None:
            trial = piece + [i]
            leaves = [lengths[j] - spine for j in trial if lengths[j] > spine]
            cost = spine + len(leaves) * round_up(max(leaves, default=0), pad_multiple)
            if cost <= token_budget and len(trial) <= max_rows and len(leaves) * spine <= cache_tokens or not piece:
                piece = trial
                continue
        leaves = [lengths[j] - spine for j in piece if lengths[j] > spine]
        out.append((piece, spine + len(leaves) * round_up(max(leaves, default=0), pad_multiple)))
        piece = [i] if i is not None else []
    return out


def cut_prefix_batches(sequences, token_budget: int, max_rows: int, pad_multiple: int, min_prefix: int,
                       cache_tokens: int) -> list[PlannedBatch]:
    """Batches over ``sequences`` with shared prefixes computed once; rows sharing none: ``cut_batches``."""
    lengths = [len(s) for s in sequences]
    pieces: list[tuple[list[int], int, int]] = []   # members, spine, computed
    alone: list[int] = []
    for members, spine in find_groups(sequences, min_prefix):
        for piece, computed in _chunks(members, lengths, spine, token_budget, max_rows, pad_multiple, cache_tokens):
            if len(piece) > 1:
                pieces.append((piece, spine, computed))
            else:
                alone += piece
    grouped = {i for piece, _, _ in pieces for i in piece}
    alone = sorted(set(alone) | (set(range(len(sequences))) - grouped))
    batches: list[PlannedBatch] = []
    current: list[tuple[list[int], int, int]] = []

    def close() -> None:
        members, groups, first = [], [], 0
        for piece, spine, _ in current:
            groups.append(PrefixGroup(first, len(piece), spine))
            members += piece
            first += len(piece)
        padded_len = round_up(max(lengths[i] for i in members), pad_multiple)
        batches.append(PlannedBatch(members, padded_len, sum(lengths[i] for i in members), len(members) * padded_len,
                                    computed=sum(c for _, _, c in current), groups=tuple(groups)))
        current.clear()

    for piece in sorted(pieces, key=lambda p: -p[2]):
        trial = current + [piece]
        fits = (sum(c for _, _, c in trial) <= token_budget and sum(len(p) for p, _, _ in trial) <= max_rows
                and sum(s * sum(lengths[i] > s for i in p) for p, s, _ in trial) <= cache_tokens)
        if current and not fits:
            close()
        current.append(piece)
    if current:
        close()
    planned = cut_batches([lengths[i] for i in alone], token_budget, max_rows, pad_multiple)
    batches += [PlannedBatch([alone[j] for j in b.members], b.padded_len, b.tokens, b.padded) for b in planned]
    return batches
