"""A batch whose samples share prefixes: each shared spine computed once, every sample stored whole.

A causal target's states at a token do not depend on what follows it, so samples that start with the same
``spine`` tokens need the spine computed once. A batch's plan (``BatchSpec.prefix_groups``, hsx/prep/prefixplan.py)
names groups of consecutive samples ``(first, count, spine)``; a group inside another's range nests in it (its
spine continues the outer one: per-turn rows of one conversation make a chain). Every other sample is computed
alone, as before. For a group:

1. its spine runs once (one row, no padding) with a transformers cache, from its parent's spine on (its
   parent's states copied) or from token 0, in pieces of at most ``chunk_tokens`` (a spine longer than a
   batch's budget is continued piece by piece, exactly): the cache then holds the attention layers' keys and
   values and the Gated DeltaNet layers' conv window and recurrent state at the branch point, wherever it falls
   (mid-chunk too: transformers' chunk rule starts from the cached state);
2. its child groups go on from a copy of those states;
3. its rows going on (its leaves, members in no child, and each chain child's longest row) wait with its
   one-row states until the groups of their segment are done, then run beside the other groups' rows in as few
   forwards as pay (hsx/prep/prefixplan.py ``merged_forwards``: a group's rows join a forward where the padding
   they add costs less than the forward saved, at the plan's price). Each row continues its own group's states:
   the states are expanded to the rows and stacked (``_merged_cache``), the attention layers' keys and values
   left-padded to the forward's longest past, and the rows right-padded at positions past .. past + n - 1 with a
   mask that lets a token see its own past and its row up to itself (``row_pasts``; rows of one past need no
   mask, transformers' own causal mask over the cache is right). A real token never sees padding, and nothing
   reads the padded rows' final states;
4. every member's stored rows are its groups' spine rows followed by its row's (a member that is the spine
   itself, a strict prefix of the others, has none).

Where the forward packs rows (gpu_worker/kernels.py ``packing_ready``, ``continuation_ready``: fused kernels with
varlen attention and GDN), the batch runs in **waves** instead (``_run_waves``): no transformers cache, no padding,
no mask. Each forward is one packed row of every piece whose states are ready, within the token budget: the
spine pieces of every group whose parent's spine is done, the rows going on from every finished spine, the rows
computed alone. Each sample continues its own ``kernels.State`` (its attention reads the state's keys then its
own; its Gated DeltaNet conv starts from the state's window and its delta rule from the state's recurrent
state), and a spine piece records its states at its end (``Pasts(record=...)``: its own keys and values, the last
conv inputs, fla's final state per sample) for the pieces that continue it. A tree of depth d runs in about d
forwards however many groups and trees the batch holds; a state's keys are held once (a child's hold only its
own tokens and point at its parent's), its Gated DeltaNet states dropped once every row continuing it has run.

Memory a batch holds beyond a plain one: a one-row cache per open group on the path from the root and per group
waiting with rows going on (at most ``MAX_HELD`` groups, their pasts within ``cache_tokens``), and the states
expanded to one forward's rows (rows x (longest past + longest row) within ``cache_tokens``, a GDN state a row);
the worker says the bound at start (``snapshot_bytes``).

The fused kernels (gpu_worker/kernels.py) continue a cache too: their Gated DeltaNet forward puts the cached conv
window before a call's inputs and starts the delta rule from the cached recurrent state (fla's kernels take
``initial_state`` / ``output_final_state``), as transformers' forward does; the caches are interchangeable.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
from collections.abc import Sequence

import torch

from gpu_worker.kernels import to_device
from hsx.defaults import DEFAULT_PREFIX_CACHE_BUDGETS, DEFAULT_PREFIX_FORWARD_TOKENS
from hsx.prep import MAX_HELD, PrefixGroup, merged_forwards
from hsx.runspec import text_config


def _cache_for(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _forest(groups: Sequence[PrefixGroup], rows: int) -> list[tuple[PrefixGroup, list]]:
    """The groups as trees (group, children): a group inside another's range nests in it (a longer spine),
    others are disjoint; ValueError for anything else."""
    ordered = sorted(groups, key=lambda g: (g.first, -g.count, g.spine))
    roots: list = []
    path: list = []   # the open groups containing the current one, outermost first
    for g in ordered:
        if g.count < 1 or g.spine < 1 or g.first < 0 or g.first + g.count > rows:
            raise ValueError(f"prefix group {tuple(g)}: not a range of the batch's {rows} samples with a spine")
        while path and g.first >= path[-1][0].first + path[-1][0].count:
            path.pop()
        if path:
            parent = path[-1][0]
            if g.first + g.count > parent.first + parent.count or g.spine <= parent.spine:
                raise ValueError(f"prefix group {tuple(g)} overlaps {tuple(parent)} without nesting in it")
        node = (g, [])
        (path[-1][1] if path else roots).append(node)
        path.append(node)
    return roots


def run_prefix_batch(extractor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, groups: Sequence[PrefixGroup],
                     chunk_tokens: int, cache_tokens: int = 0,
                     forward_tokens: int = DEFAULT_PREFIX_FORWARD_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stored tensors of a batch (packed ``input_ids`` [N], ``cu_seqlens`` [B + 1]) planned with ``groups``:
    (hidden [N, n*H], final [N, H] or None) on the extractor's device, in sample order, as ``Extractor.run``.
    ``chunk_tokens``, ``cache_tokens`` (default two of it) and ``forward_tokens``: the plan's token budget, cached
    tokens and price of a forward, so the rows going on run in the forwards the plan counted."""
    ex, device = extractor, extractor.device
    ids = input_ids.to(torch.int64)
    cu = [int(x) for x in cu_seqlens]
    n_tokens = cu[-1]
    put = _Stored(torch.empty((n_tokens, ex.width), dtype=ex.out_dtype, device=device),
                  torch.empty((n_tokens, ex.hidden_size), dtype=ex.out_dtype, device=device) if ex.store_final else None)

    forest = _forest(groups, len(cu) - 1)
    for g in groups:
        members = range(g.first, g.first + g.count)
        if any(cu[b + 1] - cu[b] < g.spine for b in members):
            raise ValueError(f"prefix group {tuple(g)}: a member is shorter than its spine")
        if any(not torch.equal(ids[cu[b]:cu[b] + g.spine], ids[cu[g.first]:cu[g.first] + g.spine]) for b in members):
            raise ValueError(f"prefix group {tuple(g)}: its members do not share the spine's tokens")
    alone = _alone(groups, cu)
    cache_tokens = cache_tokens or DEFAULT_PREFIX_CACHE_BUDGETS * chunk_tokens
    max_rows = _rows_for_states(ex, cache_tokens)
    if ex.continues:   # packed rows, each from its own states: the batch in waves
        _run_waves(ex, ids, cu, forest, alone, chunk_tokens, max_rows, cache_tokens, put)
        return put.hidden, put.final
    entries, segments = _going_plan(ex, ids, cu, forest, chunk_tokens, cache_tokens, forward_tokens)
    if ex.groupwise_price and cheaper_alone(*_feeds(ex, ids, cu, forest, alone, entries, segments, chunk_tokens,
                                                    max_rows), ex.groupwise_price):
        _run_alone(ex, ids, cu, list(range(len(cu) - 1)), chunk_tokens, put)   # each sample computed alone: exact
        return put.hidden, put.final
    going = _Going(ex, ids, cu, put, segments, max_rows, chunk_tokens)
    for node in forest:
        g = node[0]
        longest = _longest_holding_all(ids, cu, g)
        if longest is None:
            _run_group(ex, ids, cu, node, None, 0, chunk_tokens, put, going)
        else:    # a chain from token 0: its longest row alone (as planned: one forward, no padding), the rest slices
            _run_rows(ex, ids, cu, [(longest, list(range(g.first, g.first + g.count)), 0)], None, put)
    if going.segment != len(segments) or going.held:   # rows never run would be stored as uninitialised memory
        raise RuntimeError(f"prefix batch: {len(segments) - going.segment} of {len(segments)} segments of rows "
                           f"going on were not run ({len(going.held)} groups held)")
    _run_alone(ex, ids, cu, alone, chunk_tokens, put)
    return put.hidden, put.final


def _going_plan(ex, ids: torch.Tensor, cu: list[int], forest: list, chunk_tokens: int, cache_tokens: int,
                forward_tokens: int) -> tuple[list, list]:
    """(entries, segments): each group's rows going on, and the forwards that merge them as the plan counted."""
    entries = []
    for node in forest:
        if _longest_holding_all(ids, cu, node[0]) is None:
            entries += _entries(ids, cu, node)
    return entries, merged_forwards(entries, cache_tokens, forward_tokens, chunk_tokens, _takes_row_pasts(ex))


def _alone(groups: Sequence[PrefixGroup], cu: list[int]) -> list[int]:
    """The batch's rows in no group: computed alone."""
    grouped = {b for g in groups for b in range(g.first, g.first + g.count)}
    return [b for b in range(len(cu) - 1) if b not in grouped]


def _feeds(ex, ids: torch.Tensor, cu: list[int], forest: list, alone: list[int], entries: list, segments: list,
           chunk_tokens: int, max_rows: int) -> tuple[list[int], list[int]]:
    """Tokens of each forward a group-by-group worker runs for a tree batch: (with its trees, every sample alone)."""
    return (groupwise_feeds(ids, cu, forest, entries, segments, alone, chunk_tokens, max_rows, not ex.packs),
            piece_feeds([cu[b + 1] - cu[b] for b in range(len(cu) - 1)], chunk_tokens, not ex.packs))


def groupwise_costs(ex, input_ids: torch.Tensor, cu_seqlens, groups: Sequence[PrefixGroup], chunk_tokens: int,
                    cache_tokens: int = 0, forward_tokens: int = DEFAULT_PREFIX_FORWARD_TOKENS) -> tuple[list, list]:
    """``_feeds`` of a batch, counted before it runs, from ``run_prefix_batch``'s arguments (``ex``: a worker
    without packed waves): (with its trees, with every sample alone)."""
    ids, cu = input_ids.to(torch.int64), [int(x) for x in cu_seqlens]
    forest = _forest(groups, len(cu) - 1)
    cache_tokens = cache_tokens or DEFAULT_PREFIX_CACHE_BUDGETS * chunk_tokens
    entries, segments = _going_plan(ex, ids, cu, forest, chunk_tokens, cache_tokens, forward_tokens)
    return _feeds(ex, ids, cu, forest, _alone(groups, cu), entries, segments, chunk_tokens,
                  _rows_for_states(ex, cache_tokens))


def _run_alone(ex, ids: torch.Tensor, cu: list[int], alone: list[int], chunk_tokens: int, put) -> None:
    """Rows with no past to continue: packed rows (or padded ones), as a plain batch runs, a budget a forward (a
    batch of trees may store more: --prefix-stored-budgets)."""
    if not ex.packs:   # padded rows: the longest together, as a plain batch's are cut (sorted by length)
        alone = sorted(alone, key=lambda b: cu[b] - cu[b + 1])
    for piece in budget_pieces([cu[b + 1] - cu[b] for b in alone], chunk_tokens, padded=not ex.packs):
        rows = [alone[i] for i in piece]
        if ex.packs:
            _run_rows_packed(ex, ids, cu, [(b, [b], 0, cu[b + 1] - cu[b]) for b in rows], None, put)
        else:
            _run_rows(ex, ids, cu, [(b, [b], 0) for b in rows], None, put)


def groupwise_feeds(ids: torch.Tensor, cu: list[int], forest: list, entries: list, segments: list, alone: list[int],
                    chunk_tokens: int, max_rows: int, padded: bool) -> list[int]:
    """Tokens (padding in) of each forward the group-by-group runner runs for a tree batch, counted before it
    runs: each group's spine a piece of at most ``chunk_tokens`` at a time from its parent's, each chain's longest
    row, the rows going on as ``segments`` merge them (at most ``max_rows`` a forward; 0: no bound), the rows
    alone a budget at a time."""
    feeds: list[int] = []

    def spines(node, start: int) -> None:
        g = node[0]
        feeds.extend(min(chunk_tokens, g.spine - at) for at in range(start, g.spine, max(1, chunk_tokens)))
        for child in going_and_branching(ids, cu, node)[1]:
            spines(child, g.spine)

    for node in forest:
        longest = _longest_holding_all(ids, cu, node[0])
        if longest is None:
            spines(node, 0)
        else:
            feeds.append(cu[longest + 1] - cu[longest])
    for segment in segments:
        for forward in segment:
            lengths = [n for e in forward for n in entries[e][1]]
            feeds.extend(len(piece) * max(lengths[i] for i in piece)
                         for piece in row_pieces(lengths, chunk_tokens, max_rows))
    return feeds + piece_feeds([cu[b + 1] - cu[b] for b in alone], chunk_tokens, padded)


def piece_feeds(lengths: Sequence[int], budget: int, padded: bool) -> list[int]:
    """Tokens of each forward that runs ``lengths`` alone as ``_run_alone`` does, in ``budget_pieces`` (``padded``:
    longest first, rows x the longest)."""
    lengths = sorted(lengths, reverse=True) if padded else list(lengths)
    pieces = [[lengths[i] for i in piece] for piece in budget_pieces(lengths, budget, padded)]
    return [len(p) * max(p) if padded else sum(p) for p in pieces]


def cheaper_alone(trees: list[int], alone: list[int], price: int) -> bool:
    """Whether a group-by-group worker runs a tree batch faster with every sample alone: each forward (its tokens,
    padding in: ``groupwise_costs``) priced at the larger of ``price`` (its launches and host work, in tokens:
    GROUPWISE_PREFIX_FORWARD_TOKENS on the 27B) and its tokens. A plan priced for packed waves keeps trees whose
    spines each cost such a worker a forward more than they save."""
    return sum(max(price, t) for t in trees) >= sum(max(price, t) for t in alone)


def row_pieces(lengths: Sequence[int], budget: int, max_rows: int) -> list[list[int]]:
    """Indices of one planned forward's rows going on (their lengths), as the padded runner runs them: in order
    where they fit, else longest first in forwards of rows x longest within ``budget`` (a row over it alone),
    each of at most ``max_rows`` rows (0: no bound on either)."""
    everything = list(range(len(lengths)))
    if budget and len(lengths) * max(lengths, default=0) > budget:
        order = sorted(everything, key=lambda i: -lengths[i])
        pieces = [[order[i] for i in p] for p in budget_pieces([lengths[i] for i in order], budget, padded=True)]
    else:
        pieces = [everything] if lengths else []
    step = max_rows or max(1, len(lengths))
    return [p[at:at + step] for p in pieces for at in range(0, len(p), step)]


def budget_pieces(lengths: Sequence[int], budget: int, padded: bool) -> list[list[int]]:
    """Indices of ``lengths`` in order, in consecutive pieces of at most ``budget`` tokens each (``padded``: a
    piece costs its rows x its longest); a length over the budget is a piece of its own."""
    pieces: list[list[int]] = []
    piece, total, longest = [], 0, 0
    for i, n in enumerate(lengths):
        cost = max(longest, n) * (len(piece) + 1) if padded else total + n
        if piece and cost > budget:
            pieces.append(piece)
            piece, total, longest = [], 0, 0
        piece.append(i)
        total, longest = total + n, max(longest, n)
    return pieces + [piece] if piece else pieces


class _Stored:
    """The batch's stored tensors, written as forwards return: ``put(runs, got)`` copies ``got``'s rows ``src ..
    src + n - 1`` to rows ``dest ..`` for each (dest, src, n) by slices; ``put.spread(starts, got)`` writes a spine
    piece to every member's rows at once (one indexed write, the piece broadcast: no copy a member, which for a 3k
    spine of 30 members would be ~4.6 GB of the 27B's five stored layers, and no index built a token)."""

    def __init__(self, hidden: torch.Tensor, final: torch.Tensor | None):
        self.hidden, self.final = hidden, final

    def __call__(self, runs: list[tuple[int, int, int]], got: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        for dest, src, n in runs:
            self.hidden[dest:dest + n] = got[0][src:src + n]
            if self.final is not None:
                self.final[dest:dest + n] = got[1][src:src + n]

    def spread(self, starts: list[int], got: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        device = self.hidden.device
        rows = (to_device(torch.tensor(starts, dtype=torch.int64), device).unsqueeze(1)
                + torch.arange(got[0].shape[0], device=device))
        self.hidden[rows] = got[0]
        if self.final is not None:
            self.final[rows] = got[1]


def _run_group(ex, ids: torch.Tensor, cu: list[int], node, cache, start: int, chunk_tokens: int, put,
               going: _Going) -> None:
    """A group's spine from ``start`` (its parent's spine; ``cache``: the parent's states there, kept), then its
    branching child groups from a copy of its own states, then the rows going on from its spine (its leaves, and
    each chain child's longest row: tool-call steps cut one a sample, every member a prefix of that row), handed
    to ``going`` with its states: they run beside other groups' rows, each from its own states."""
    g = node[0]
    device = ex.device
    cache = _cache_for(ex.model) if cache is None else copy.deepcopy(cache)
    spine = to_device(ids[cu[g.first]:cu[g.first] + g.spine], device)
    members = range(g.first, g.first + g.count)
    for at in range(start, g.spine, max(1, chunk_tokens)):
        end = min(g.spine, at + chunk_tokens)
        got = ex.forward_packed(spine[at:end].unsqueeze(0), torch.arange(end - at, device=device), end - at,
                                cache=cache, start=at)
        put.spread([cu[b] + at for b in members], got)
    rows, branching = going_and_branching(ids, cu, node)
    for child in branching:
        _run_group(ex, ids, cu, child, cache, g.spine, chunk_tokens, put, going)
    if rows:
        going.add(cache, g.spine, rows)


def _entries(ids: torch.Tensor, cu: list[int], node) -> list[tuple[int, list[int]]]:
    """(past, the lengths of its rows going on) of each group under ``node`` with rows going on, in the order
    ``_run_group`` finishes them (hsx/prep/prefixplan.py ``going_entries`` counts the same from lengths)."""
    rows, branching = going_and_branching(ids, cu, node)
    out = [e for child in branching for e in _entries(ids, cu, child)]
    spine = node[0].spine
    return out + ([(spine, [cu[b + 1] - cu[b] - spine for b in rows])] if rows else [])


def going_and_branching(ids: torch.Tensor, cu: list[int], node) -> tuple[dict[int, list[int]], list]:
    """A group's rows going on from its spine, each with the members it stores (its leaves; each chain child's
    longest row, holding that child's members: tool-call steps cut one a sample, every member a prefix of it), and
    its branching children (run as groups of their own). hsx/prep/prefixplan.py ``Tree._rows_going_on`` is the
    planner's count of the same, by lengths."""
    g, children = node
    going, branching, inside = {}, [], set()
    for child in children:
        c = child[0]
        inside.update(range(c.first, c.first + c.count))
        longest = _longest_holding_all(ids, cu, c)
        if longest is None:
            branching.append(child)
        else:
            going[longest] = list(range(c.first, c.first + c.count))
    going.update({b: [b] for b in range(g.first, g.first + g.count) if b not in inside and cu[b + 1] - cu[b] > g.spine})
    return going, branching


class _Going:
    """The rows going on from each group's states, collected as the groups' spines finish and run as the plan
    counted them (hsx/prep/prefixplan.py ``merged_forwards``: segments of at most MAX_HELD groups, within a
    segment groups' rows merged into one forward where the padding that adds costs less than the forward it
    saves). Each row continues its own group's states: the attention layers' keys and values left-padded to the
    longest past and masked, each Gated DeltaNet row its own conv window and recurrent state (``_merged_cache``).
    Where the model cannot take such a mask (``_takes_row_pasts``), only groups of one past length merge. (A
    worker whose forward packs rows runs the batch in waves instead: ``_run_waves``.)"""

    def __init__(self, ex, ids: torch.Tensor, cu: list[int], put, segments: list[list[list[int]]], max_rows: int = 0,
                 budget: int = 0):
        self.ex, self.ids, self.cu, self.put = ex, ids, cu, put
        # max_rows: rows a forward at most; budget: its rows x longest row at most (a plan for packing workers
        # keeps a group's rows of any length: ``row_pieces``); 0: no bound
        self.segments, self.max_rows, self.budget = segments, max_rows, budget
        self.held: list[tuple[object, int, dict[int, list[int]]]] = []   # (one-row cache, past, rows going on)
        self.segment = self.done = 0   # the segment being held; entries of the segments before it (run)

    def add(self, cache, past: int, rows: dict[int, list[int]]) -> None:
        self.held.append((cache, past, rows))
        segment = self.segments[self.segment]
        if len(self.held) == sum(len(f) for f in segment):
            self._run(segment)
            self.segment += 1

    def _run(self, segment: list[list[int]]) -> None:
        for forward in segment:
            rows = [(e, b, held) for e in forward for b, held in self.held[e - self.done][2].items()]
            past = {e: self.held[e - self.done][1] for e in forward}
            lengths = [self.cu[b + 1] - self.cu[b] - past[e] for e, b, _ in rows]
            for indices in row_pieces(lengths, self.budget, self.max_rows):   # at most max_rows GDN states at once
                piece = [rows[i] for i in indices]
                entries = list(dict.fromkeys(e for e, _, _ in piece))
                parts = [self.held[e - self.done] for e in entries]
                counts = [sum(e == f for f, _, _ in piece) for e in entries]
                going = [(b, held, self.held[e - self.done][1]) for e, b, held in piece]
                cache = _merged_cache(self.ex, [c for c, _, _ in parts], counts, [p for _, p, _ in parts])
                _run_rows(self.ex, self.ids, self.cu, going, cache, self.put)
        self.done += len(self.held)
        self.held = []


class _Item:
    """A piece of a wave: tokens ``start`` .. ``end`` - 1 of sample ``row``, continuing ``state`` (its first
    ``start`` tokens' states; None: from token 0). A spine piece (``node``: its group) records its states at ``end``
    and is stored for every member of its group; a row going on is stored for the members it holds (``held``)."""

    __slots__ = ("row", "start", "end", "state", "node", "held")

    def __init__(self, row: int, start: int, end: int, state, node=None, held: list[int] | None = None):
        self.row, self.start, self.end, self.state, self.node, self.held = row, start, end, state, node, held


def _run_waves(ex, ids: torch.Tensor, cu: list[int], forest: list, alone: list[int], token_budget: int,
               max_rows: int, cache_tokens: int, put) -> None:
    """A packing forward's way through a tree batch: every piece whose states are ready runs in one packed
    forward, within the batch's token budget. A wave holds the spine pieces of every group whose parent's spine
    is done (each recording its states at its end: ``kernels.Pasts``), the rows going on from every finished
    spine and the rows computed alone, each sample from its own states: no padding, no mask, and a tree of depth
    d runs in about d forwards however many groups and trees the batch holds. A spine longer than the room left
    goes on piece by piece. ``max_rows``: the samples continuing or recording states in one forward at most (0: no
    bound); ``cache_tokens``: the keys a forward's samples read at most (pasts and own tokens: one attention
    layer's gather at a time); a spine piece is taken only while fewer than ``MAX_HELD`` states are held. Where
    nothing fits these bounds (a row longer than the budget, the states all held by waiting spine pieces), the
    first piece runs alone, so every forward runs something.
    Rows going on come first (they free states), then spine pieces, then rows from token 0."""
    ready: list[_Item] = []
    for node in forest:
        g = node[0]
        longest = _longest_holding_all(ids, cu, g)
        if longest is None:
            ready.append(_Item(g.first, 0, g.spine, None, node))
        else:   # a chain from token 0: its longest row, every member a prefix of it
            ready.append(_Item(longest, 0, cu[longest + 1] - cu[longest], None,
                               held=list(range(g.first, g.first + g.count))))
    ready += [_Item(b, 0, cu[b + 1] - cu[b], None, held=[b]) for b in alone]
    while ready:
        ready.sort(key=lambda it: 0 if it.state is not None and it.node is None else 1 if it.node is not None else 2)
        held = {id(it.state) for it in ready if it.state is not None}
        for force in (False, True):   # forced: nothing fitted its bounds, so the first piece runs (one a forward)
            taken, later, tokens, stateful, recording, keys = [], [], 0, 0, 0, 0
            for item in ready:
                n = item.end - item.start
                room = token_budget - tokens if token_budget else n
                counts = item.state is not None or item.node is not None
                fits = (force and not taken) or (
                    room > 0 and not (counts and max_rows and stateful >= max_rows)
                    and (item.node is not None or n <= room) and keys + item.start + min(n, room) <= cache_tokens
                    and (item.node is None or len(held) + recording < MAX_HELD))
                if not fits:
                    later.append(item)
                    continue
                if item.node is not None and 0 < room < n:   # a spine piece cut to the room left; the rest goes on
                    item = _Item(item.row, item.start, item.start + room, item.state, item.node)
                taken.append(item)
                tokens += item.end - item.start
                keys += item.end
                stateful += counts
                recording += item.node is not None
            if taken:
                break
        record = [i for i, it in enumerate(taken) if it.node is not None]
        got, pasts, bounds = _run_rows_packed(ex, ids, cu, [(it.row, it.held or [], it.start, it.end) for it in taken],
                                              [it.state for it in taken], put, record)
        for i in record:   # each spine piece, stored for every member of its group
            it, g, state = taken[i], taken[i].node[0], pasts.recorded[i]
            part = tuple(None if t is None else t[bounds[i]:bounds[i + 1]] for t in got)
            put.spread([cu[b] + it.start for b in range(g.first, g.first + g.count)], part)
            if it.end < g.spine:   # cut to the room its forward had: the rest goes on from its states
                later.append(_Item(it.row, it.end, g.spine, state, it.node))
            else:   # the spine done: its branching groups and rows going on continue its states
                rows, branching = going_and_branching(ids, cu, it.node)
                later += [_Item(child[0].first, g.spine, child[0].spine, state, child) for child in branching]
                later += [_Item(b, g.spine, cu[b + 1] - cu[b], state, held=members) for b, members in rows.items()]
        still = {id(it.state) for it in later if it.state is not None}
        for it in taken:
            if it.state is not None and id(it.state) not in still:
                it.state.release()   # every row continuing it has run
        ready = later


def _rows_for_states(ex, cache_tokens: int) -> int:
    return rows_for_states(ex.model.config, cache_tokens, next(ex.model.parameters()).element_size())


def _takes_row_pasts(ex) -> bool:
    """Can one forward of this model continue rows of different past lengths? Its attention must take a given
    boolean mask (SDPA) by layer type (a transformers decoder whose forward accepts a dict of masks), and its
    layers only full attention and Gated DeltaNet (no sliding window)."""
    config = text_config(ex.model.config)
    types = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "_attn_implementation", None) != "sdpa" or not types <= {"full_attention", "linear_attention"}:
        return False
    return _forward_takes_mask_dict(type(ex.decoder))


@functools.cache
def _forward_takes_mask_dict(decoder_class) -> bool:
    try:
        return "isinstance(causal_mask_mapping := attention_mask, dict)" in inspect.getsource(decoder_class.forward)
    except (OSError, TypeError):
        return False


def _merged_cache(ex, caches: list, counts: list[int], pasts: list[int]):
    """One cache for ``counts[i]`` rows of each one-row ``caches[i]`` (``pasts[i]`` tokens), in that order: each
    state tensor expanded to its rows and stacked (one copy: the held caches are not changed); keys and values of
    different past lengths left-padded to the longest (the mask hides the padding). ValueError for a layout it
    does not know."""
    merged = copy.copy(caches[0])
    merged.layers = [copy.copy(layer) for layer in caches[0].layers]
    width = max(pasts)
    for i, layer in enumerate(merged.layers):
        for name in list(vars(layer)):
            values = [vars(c.layers[i])[name] for c in caches]
            setattr(layer, name, _stacked(values, counts, pasts, width, f"layer {i} {name}", "length" in name))
    return merged


def _stacked(values: list, counts: list[int], pasts: list[int], width: int, what: str, counter: bool):
    """``values`` (one layer attribute of each cache: a tensor, or a dict / list of them) for the merged rows.
    ``counter``: a scalar tensor of it counts tokens (transformers 5.2x's ``cumulative_length_linear``): the
    merged keys' width, set from the pasts (reading the tensor would wait for the GPU)."""
    first = values[0]
    if isinstance(first, dict):
        return {k: _stacked([v[k] for v in values], counts, pasts, width, f"{what}[{k!r}]", counter) for k in first}
    if isinstance(first, (list, tuple)) and first and any(torch.is_tensor(v) for v in first):
        return type(first)(_stacked([v[k] for v in values], counts, pasts, width, f"{what}[{k}]", counter)
                           for k in range(len(first)))
    if not torch.is_tensor(first):
        return first
    if first.dim() == 0:
        return torch.full_like(first, width) if counter else first
    if any(v.shape[0] != 1 for v in values):
        raise ValueError(f"cache {what}: not one row a group")
    if all(v.shape == first.shape for v in values):   # a state (or keys of one past length): rows stacked
        return torch.cat([v.expand(n, *v.shape[1:]) for v, n in zip(values, counts, strict=True)])
    if first.dim() < 2 or any(v.shape[-2] != p or v.shape[:-2] != first.shape[:-2] or v.shape[-1] != first.shape[-1]
                              for v, p in zip(values, pasts, strict=True)):
        raise ValueError(f"cache {what}: shapes {[tuple(v.shape) for v in values]} are neither states nor "
                         f"keys of {pasts} tokens")
    padded = [torch.nn.functional.pad(v, (0, 0, width - p, 0)) for v, p in zip(values, pasts, strict=True)]
    return torch.cat([v.expand(n, *v.shape[1:]) for v, n in zip(padded, counts, strict=True)])


def _longest_holding_all(ids: torch.Tensor, cu: list[int], g: PrefixGroup) -> int | None:
    """The member of ``g`` of which every other member is a prefix, or None."""
    members = range(g.first, g.first + g.count)
    longest = max(members, key=lambda b: cu[b + 1] - cu[b])
    whole = ids[cu[longest]:cu[longest + 1]]
    for b in members:
        if not torch.equal(ids[cu[b]:cu[b + 1]], whole[:cu[b + 1] - cu[b]]):
            return None
    return longest


def _run_rows(ex, ids: torch.Tensor, cu: list[int], rows: list[tuple[int, list[int], int]], cache, put) -> None:
    """Rows' tokens, each (row, the members it stores, its past: tokens skipped, held in ``cache``), right-padded
    in one forward (continuing ``cache`` if given); each row's output is stored for the members it holds (itself,
    or a chain's members, each a prefix of it: a causal model's state at a token does not depend on what follows).
    Rows of different pasts get their own positions and a mask over the cache's left-padded keys."""
    device = ex.device
    lengths = [cu[b + 1] - cu[b] - skip for b, _, skip in rows]
    width = max(lengths)
    pasts = [skip for _, _, skip in rows]
    start = max(pasts)
    padded = torch.zeros((len(rows), width), dtype=torch.int64)   # padding: never seen by a real token
    flat, runs = [], []
    for r, (b, held, skip) in enumerate(rows):
        padded[r, :lengths[r]] = ids[cu[b] + skip:cu[b + 1]]
        for m in held:
            n = cu[m + 1] - cu[m] - skip
            runs.append((cu[m] + skip, len(flat), n))
            flat.extend(range(r * width, r * width + n))
    flat_index = to_device(torch.tensor(flat, dtype=torch.int64), device)
    extra = {}
    if len(set(pasts)) > 1:
        extra = row_pasts(ex, to_device(torch.tensor(pasts, dtype=torch.int64), device), start, width)
    put(runs, ex.forward_packed(to_device(padded, device), flat_index, len(flat), cache=cache, start=start, **extra))


def _run_rows_packed(ex, ids: torch.Tensor, cu: list[int], rows: list[tuple[int, list[int], int, int]],
                     states: list | None, put, record: Sequence[int] = ()):
    """Rows as one packed row: no padding, no mask. Each row (row, the members it stores, start, end) runs its
    tokens start .. end - 1, continuing ``states[i]`` (a ``kernels.State`` of its first ``start`` tokens; None:
    from token 0): its attention reads the state's keys then its own, each Gated DeltaNet row starts from the
    state's conv window and recurrent state (gpu_worker/kernels.py ``Pasts``). ``record``: the rows whose states
    at ``end`` are kept (``pasts.recorded``). Each row's output is stored for the members it holds (each a prefix
    of it). (got, pasts or None, the rows' bounds in got)."""
    from gpu_worker.extractor import PackedBatch
    from gpu_worker.kernels import Pasts

    lengths = [end - start for _, _, start, end in rows]
    bounds = [0, *itertools.accumulate(lengths)]
    tokens = torch.cat([ids[cu[b] + start:cu[b] + end] for b, _, start, end in rows]).reshape(1, -1)
    positions = torch.cat([torch.arange(start, end) for _, _, start, end in rows])
    if ex.device.type == "cuda":
        tokens, positions = tokens.pin_memory(), positions.pin_memory()
    batch = PackedBatch(tokens, positions.reshape(1, -1), torch.tensor(bounds, dtype=torch.int64), max(lengths),
                        bounds[-1])
    past = None
    if record or (states is not None and any(s is not None for s in states)):
        states = states or [None] * len(rows)
        if any((0 if s is None else s.past) != start for s, (_, _, start, _) in zip(states, rows, strict=True)):
            raise ValueError("packed rows: a row's states do not end where its tokens start")
        config = text_config(ex.model.config)
        window = getattr(config, "linear_conv_kernel_dim", 0) if "linear_attention" in (
            getattr(config, "layer_types", None) or ()) else 0
        past = Pasts(states, lengths, window, ex.device, record)
    got = ex.forward_rows(batch, past=past)
    put([(cu[m] + start, bounds[r], cu[m + 1] - cu[m] - start)
         for r, (_, held, start, _) in enumerate(rows) for m in held], got)
    return got, past, bounds


def row_pasts(ex, pasts: torch.Tensor, start: int, width: int) -> dict:
    """A forward's arguments for rows continuing pasts of ``pasts`` tokens from a cache left-padded to ``start``:
    each row's positions (past .. past + width - 1) and, for the attention layers, a boolean mask [B, 1, width,
    start + width] letting a token see its own past and the tokens of its row up to itself."""
    t = torch.arange(width, device=pasts.device)
    key = torch.arange(start + width, device=pasts.device)
    past_seen = (key >= start - pasts.unsqueeze(1)) & (key < start)                       # [B, keys]
    causal = (key.unsqueeze(0) >= start) & (key.unsqueeze(0) - start <= t.unsqueeze(1))   # [width, keys]
    mask = (past_seen.unsqueeze(1) | causal.unsqueeze(0)).unsqueeze(1)
    types = set(getattr(text_config(ex.model.config), "layer_types", None) or ("full_attention",))
    return {"positions": pasts.unsqueeze(1) + t, "attention_mask": {k: mask if k == "full_attention" else None
                                                                     for k in types}}


def state_sizes(model_config, dtype_bytes: int) -> tuple[int, int]:
    """(bytes of keys and values a cached token, bytes of Gated DeltaNet states a row: every GDN layer's conv
    window and fp32 recurrent state; 0 for a model without GDN layers)."""
    c = text_config(model_config)
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    attention = sum(t != "linear_attention" for t in types)
    linear = len(types) - attention
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = 2 * c.num_key_value_heads * head_dim * attention * dtype_bytes
    if not linear:
        return kv, 0
    k, v = c.linear_key_head_dim, c.linear_value_head_dim
    conv_dim = 2 * c.linear_num_key_heads * k + c.linear_num_value_heads * v
    return kv, linear * (c.linear_num_value_heads * k * v * 4 + conv_dim * (c.linear_conv_kernel_dim - 1) * dtype_bytes)


def rows_for_states(model_config, cache_tokens: int, dtype_bytes: int) -> int:
    """The most rows one forward continues from cached states: their Gated DeltaNet states within the bytes of
    ``cache_tokens`` tokens of keys and values (the 27B: ~151 MB a row, 64 KB a token: 27 rows at 65,536
    tokens). A planned forward of more rows runs as several, each padded to its own longest row (no more tokens
    than planned). 0: no bound (a model without GDN layers)."""
    kv, state = state_sizes(model_config, dtype_bytes)
    return max(1, cache_tokens * kv // state) if state else 0


def snapshot_bytes(model_config, cache_tokens: int, max_rows: int, dtype_bytes: int) -> int:
    """The most a batch's prefix groups hold beyond a plain batch: keys and values of every attention layer for
    ``cache_tokens`` tokens expanded to the rows going on, and as many in the groups' one-row states held for them
    (a segment's pasts stay within ``cache_tokens``: hsx/prep/prefixplan.py ``merged_forwards``); the Gated
    DeltaNet states of one forward's rows (``rows_for_states``, at most ``max_rows``) and of MAX_HELD held
    groups."""
    kv, state = state_sizes(model_config, dtype_bytes)
    rows = min(max_rows, rows_for_states(model_config, cache_tokens, dtype_bytes) or max_rows)
    return 2 * cache_tokens * kv + state * (rows + MAX_HELD)
