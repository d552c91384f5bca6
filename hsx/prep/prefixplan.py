"""Planning shared prefixes: rows that start with the same tokens share computed spines.

Rows of a window are sorted by their token ids; neighbours in that order share their longest common prefix
(lcp). A run of neighbours whose lcp is at least ``min_prefix`` tokens is a tree of groups: its root's spine is
the run's smallest lcp, computed once; where the run splits (at that smallest lcp) into sub-runs that share
at least ``min_prefix`` more tokens, each sub-run is a child group whose spine continues its parent's; every
row in no child is a leaf of its group, computing only its remainder. Per-turn rows of one conversation make a
chain of groups (turn k's history is the spine of turns k+1..), rows of one system prompt a root over them.

A tree's cost is what it computes: each group's spine beyond its parent's, plus its rows going on (``packed``,
planned for workers that pack rows: each its own tokens; else each padded to the group's longest); a batch
holds trees whose costs sum to at most the token budget, and whose stored tokens do too (the worker's output
and pinned buffers, and the batch file, hold a budget's tokens), whose leaves x spine (the cache expanded to a
group's leaves: gpu_worker/prefixrun.py) stay under ``cache_tokens``. A tree too large for one
batch is cut: its child groups become trees of their own (their spines computed again from token 0) and its
own leaves are cut into pieces that each compute the spine again. A batch holds trees, or rows computed alone
only (``cut_batches``); a packed plan lets rows computed alone ride in a tree batch's room (they fill its waves).

Forwards are priced too (``forward_tokens`` a forward, measured: hsx/defaults.py): a tree is made, and a nested
group kept, only where it saves more tokens than its spines' forwards cost. A group whose members are all
prefixes of one of them (a chain: tool-call steps cut one a sample) costs no forward of its own: the worker runs
its longest row with its parent's leaves. The rows going on from a batch's groups (their leaves and chains) run
together, as ``merged_forwards`` says (a group's rows join a forward where the padding they add costs less than
the forward saved); a batch's computed tokens (``batch_computed``) count them as run, padding in, so the plan
states what the worker computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hsx.defaults import DEFAULT_PREFIX_FORWARD_TOKENS
from hsx.prep.planning import PlannedBatch, cut_batches, round_up

MAX_DEPTH = 200   # groups nested at most (deeper sub-runs stay leaves of the deepest group)


class PrefixGroup(NamedTuple):
    """Samples ``first`` .. ``first + count - 1`` of a batch start with the same ``spine`` tokens. Groups of a
    batch nest (a group inside another's range has a longer spine and continues it) or are disjoint."""

    first: int
    count: int
    spine: int


@dataclass
class Tree:
    """A group of rows (positions into the window) sharing ``spine`` tokens, its child groups and its leaves."""

    spine: int
    children: list[Tree] = field(default_factory=list)
    leaves: list[int] = field(default_factory=list)

    def rows(self) -> list[int]:
        """Members in batch order: each child's, then the leaves (every group's members contiguous)."""
        return [i for c in self.children for i in c.rows()] + self.leaves

    def chain_end(self, lengths) -> int | None:
        """The longest member's length where every member is a prefix of it (one branch at most at each level:
        tool-call steps cut one a sample): the worker runs such a group as that one row, with its parent's
        leaves (or, at the top, alone in one forward). None where the group branches."""
        going = [lengths[i] for i in self.leaves if lengths[i] > self.spine]
        if len(going) + len(self.children) > 1:
            return None
        if self.children:
            return self.children[0].chain_end(lengths)
        return going[0] if going else self.spine

    def _rows_going_on(self, lengths) -> tuple[list[int], list[Tree]]:
        """The lengths of the rows run from this spine in one forward (leaves going on, and each chain child's
        longest row), and the children that branch (run as groups of their own)."""
        going = [lengths[i] for i in self.leaves if lengths[i] > self.spine]
        branching = []
        for c in self.children:
            end = c.chain_end(lengths)
            if end is None:
                branching.append(c)
            else:
                going.append(end)
        return going, branching

    def cost(self, lengths, pad_multiple: int, parent: int = 0, packed: bool = False) -> int:
        """Tokens computed: the spines, and the rows going on from each (``packed``: each its own remainder, as a
        packing worker runs them; else each padded to its group's longest)."""
        end = self.chain_end(lengths)
        if end is not None:
            return end - parent
        going, branching = self._rows_going_on(lengths)
        if packed:
            rows = sum(going) - len(going) * self.spine
        else:
            rows = len(going) * round_up(max(going, default=self.spine) - self.spine, pad_multiple)
        return self.spine - parent + rows + sum(c.cost(lengths, pad_multiple, self.spine, packed) for c in branching)

    def forwards(self, lengths) -> int:
        """Forwards the worker runs for this group and its children: its spine, the rows going on from it (one
        forward), and each branching child's own."""
        if self.chain_end(lengths) is not None:
            return 1
        going, branching = self._rows_going_on(lengths)
        return 1 + bool(going) + sum(c.forwards(lengths) for c in branching)

    def cached(self, lengths) -> int:
        """The most tokens of cache a group holds expanded to the rows going on from its spine."""
        if self.chain_end(lengths) is not None:
            return 0
        going, branching = self._rows_going_on(lengths)
        return max([self.spine * len(going)] + [c.cached(lengths) for c in branching])

    def groups(self, first: int = 0) -> list[PrefixGroup]:
        out, at = [PrefixGroup(first, len(self.rows()), self.spine)], first
        for c in self.children:
            out += c.groups(at)
            at += len(c.rows())
        return out


MAX_HELD = 16   # groups' one-row states a worker holds at once for rows going on (gpu_worker/prefixrun.py)


def going_entries(trees: list[Tree], lengths) -> tuple[list[tuple[int, list[int]]], int]:
    """The rows going on from each group's states, in the order the worker's runner finishes the groups (each
    branching child before its parent, trees in batch order), as (past, the row lengths after it); and the
    tokens of the spines (a chain at the top: its longest row, run alone)."""
    entries: list[tuple[int, list[int]]] = []
    spines = 0

    def walk(t: Tree, parent: int) -> None:
        nonlocal spines
        spines += t.spine - parent
        going, branching = t._rows_going_on(lengths)
        for c in branching:
            walk(c, t.spine)
        if going:
            entries.append((t.spine, [n - t.spine for n in going]))

    for t in trees:
        end = t.chain_end(lengths)
        if end is not None:
            spines += end
        else:
            walk(t, 0)
    return entries, spines


def merged_forwards(entries: list[tuple[int, list[int]]], cache_tokens: int, forward_tokens: int, token_budget: int,
                    mixed_pasts: bool = True) -> list[list[list[int]]]:
    """How the rows going on from a batch's groups run: ``entries`` (past, its rows' lengths after it) in the
    order the groups finish. Held in segments (at most MAX_HELD groups, their pasts within ``cache_tokens``);
    within a segment, largest row first, a group's rows join a forward where the padding they add (each padded
    to the forward's longest) is under ``forward_tokens`` (what a forward costs beside its tokens), the forward
    stays within ``token_budget`` tokens and ``cache_tokens`` of keys (rows x (longest past + longest row)), and
    (unless ``mixed_pasts``) its past is the forward's. Returns segments, each its forwards (entry indices)."""
    segments: list[list[int]] = []
    held = 0
    for e, (past, _) in enumerate(entries):
        if not segments or len(segments[-1]) >= MAX_HELD or held + past > cache_tokens:
            segments.append([])
            held = 0
        segments[-1].append(e)
        held += past
    out = []
    for segment in segments:
        forwards: list[list[int]] = []
        for e in sorted(segment, key=lambda e: -max(entries[e][1])):
            past, lengths = entries[e]
            for forward in forwards:
                width = max(entries[forward[0]][1])   # the forward's longest row: its first entry's
                rows = sum(len(entries[f][1]) for f in forward) + len(lengths)
                longest_past = max(past, *(entries[f][0] for f in forward))
                if (sum(width - n for n in lengths) < forward_tokens and rows * width <= token_budget
                        and rows * (longest_past + width) <= cache_tokens
                        and (mixed_pasts or past == entries[forward[0]][0])):
                    forward.append(e)
                    break
            else:
                forwards.append([e])
        out.append(forwards)
    return out


def batch_computed(trees: list[Tree], lengths, pad_multiple: int, cache_tokens: int, forward_tokens: int,
                   token_budget: int, packed: bool = False) -> int:
    """The tokens a tree batch computes (padding in), as the worker runs it: each spine once, the rows going on
    from all its groups in ``merged_forwards`` (``packed``: each row its own tokens, no padding)."""
    entries, computed = going_entries(trees, lengths)
    if packed:
        return computed + sum(sum(rows) for _, rows in entries)
    for segment in merged_forwards(entries, cache_tokens, forward_tokens, token_budget):
        for forward in segment:
            width = round_up(max(max(entries[e][1]) for e in forward), pad_multiple)
            computed += sum(len(entries[e][1]) for e in forward) * width
    return computed


def _going_forwards(t: Tree, lengths) -> int:
    """Groups of ``t`` (and its branching children) with rows going on: one forward each when run alone."""
    going, branching = t._rows_going_on(lengths)
    return bool(going) + sum(_going_forwards(c, lengths) for c in branching)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def find_trees(sequences, min_prefix: int, forward_tokens: int = DEFAULT_PREFIX_FORWARD_TOKENS,
               packed: bool = False) -> list[Tree]:
    """The groups of ``sequences`` (token ids of each row) sharing at least ``min_prefix`` tokens, as trees.
    ``packed``: planned for workers that pack a group's rows going on (no padding): every leaf is kept."""
    seqs = [np.asarray(s, dtype=">u4") for s in sequences]   # big-endian: byte order = token order
    lengths = [len(s) for s in seqs]
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].tobytes())
    lcp = [0] + [_common(seqs[order[k - 1]], seqs[order[k]]) for k in range(1, len(order))]

    def subruns(lo: int, hi: int, spine: int) -> list[tuple[int, int]]:
        cuts = [k for k in range(lo + 1, hi) if lcp[k] == spine]
        bounds = [lo, *cuts, hi]
        return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b - a >= 2]

    def grow(node: Tree, lo: int, hi: int, depth: int) -> None:
        """Children of ``node`` over sorted positions lo..hi-1 (they share node.spine); the rest leaves."""
        stack, inside = subruns(lo, hi, node.spine) if depth < MAX_DEPTH else [], set()
        while stack:
            a, b = stack.pop()
            spine = min(lcp[a + 1:b])
            if spine - node.spine >= min_prefix:
                child = Tree(spine)
                grow(child, a, b, depth + 1)
                if len(child.rows()) >= 2:   # else its rows are candidate leaves of this group
                    node.children.append(child)
                    inside.update(k for k in range(a, b) if order[k] in set(child.rows()))
            else:   # too little more shared to be worth a group of its own: look deeper
                stack += subruns(a, b, spine)
        node.children.sort(key=lambda c: min(c.rows()))
        node.leaves = _worth_padding([order[k] for k in range(lo, hi) if k not in inside], node.spine)

    def _worth_padding(leaves: list[int], spine: int) -> list[int]:
        """The leaves worth continuing together: they are padded to the longest kept one (top), so a leaf of l
        tokens costs top in the group against spine + l alone; the top keeping the most saved tokens is chosen
        (members: the leaves with top - spine < l <= top, a contiguous range by length). O(n log n)."""
        import bisect

        if packed:   # no padding: every leaf saves its spine
            return sorted(leaves)
        done = [i for i in leaves if lengths[i] <= spine]   # strict prefixes of the spine: nothing to compute
        going = sorted((lengths[i] - spine, i) for i in leaves if lengths[i] > spine)
        lefts = [left for left, _ in going]
        csum = [0, *np.cumsum(lefts).tolist()]
        best, pick = 0, (0, 0)
        for j in range(len(going)):
            top = lefts[j]
            if j + 1 < len(going) and lefts[j + 1] == top:
                continue   # the last of equal lengths: its range holds them all
            lo = bisect.bisect_right(lefts, top - spine)
            saved = (j + 1 - lo) * (spine - top) + csum[j + 1] - csum[lo]
            if saved > best:
                best, pick = saved, (lo, j + 1)
        return sorted(done + [i for _, i in going[pick[0]:pick[1]]])

    def spine_forwards(t: Tree) -> int:
        """The forwards ``t`` adds: its spines' (a chain: its one row). The rows going on from its groups ride in
        forwards shared with the batch's other groups (``merged_forwards``), so they are not priced a forward
        each."""
        return max(1, t.forwards(lengths) - _going_forwards(t, lengths))

    def price(t: Tree, rows: list[int]) -> int:
        """What ``rows`` cost planned as ``t``: its computed tokens, its spines' forwards at ``forward_tokens``,
        and the rows it left out computed alone."""
        kept = set(t.rows())
        return (t.cost(lengths, 1, packed=packed) + forward_tokens * spine_forwards(t)
                + sum(lengths[i] for i in rows if i not in kept))

    def prune(node: Tree) -> None:
        """Bottom up, each child group kept only where it saves more than it costs (its spine's forward against
        the tokens it saves): otherwise its rows go on from this group's spine as leaves. Not weighed: a chain
        child (it rides in this group's forward of rows going on, no forward of its own) and a child that saves
        more than twice its forwards' price in spine tokens alone (so a window of thousands of conversations
        under one prompt is not weighed child by child)."""
        for c in node.children:
            prune(c)
        for c in list(node.children):
            if c.chain_end(lengths) is not None or (
                    (len(c.rows()) - 1) * (c.spine - node.spine) > 2 * forward_tokens * spine_forwards(c)):
                continue
            rows = node.rows()
            trial = Tree(node.spine, children=[x for x in node.children if x is not c],
                         leaves=_worth_padding(node.leaves + c.rows(), node.spine))
            if price(trial, rows) < price(node, rows):
                node.children, node.leaves = trial.children, trial.leaves

    trees, start = [], 0
    for k in range(1, len(order) + 1):
        if k == len(order) or lcp[k] < min_prefix:
            spine = min(lcp[start + 1:k], default=0)
            if k - start >= 2:
                tree = Tree(spine)
                grow(tree, start, k, 0)
                prune(tree)
                rows = tree.rows()
                alone = sum(len(seqs[i]) for i in rows)
                if len(rows) >= 2 and tree.cost(lengths, 1, packed=packed) + forward_tokens * spine_forwards(tree) < alone:
                    trees.append(tree)
            start = k
    return trees


def find_groups(sequences, min_prefix: int, forward_tokens: int = DEFAULT_PREFIX_FORWARD_TOKENS,
                packed: bool = False) -> list[tuple[list[int], int]]:
    """Every group of ``find_trees``, flat: (its rows, its spine)."""
    out = []

    def walk(t: Tree) -> None:
        out.append((sorted(t.rows()), t.spine))
        for c in t.children:
            walk(c)

    for t in find_trees(sequences, min_prefix, forward_tokens, packed):
        walk(t)
    return out


def _fits(tree: Tree, lengths, token_budget: int, max_rows: int, pad_multiple: int, cache_tokens: int,
          stored_budget: int | None = None, packed: bool = False) -> bool:
    """Computed tokens within the budget and stored ones within ``stored_budget`` (default the budget: the
    worker's output and pinned buffers hold a budget's tokens), rows within max_rows, the expanded cache within
    cache_tokens."""
    rows = tree.rows()
    return (tree.cost(lengths, pad_multiple, packed=packed) <= token_budget
            and sum(lengths[i] for i in rows) <= (stored_budget or token_budget)
            and len(rows) <= max_rows and tree.cached(lengths) <= cache_tokens)


def _fit(tree: Tree, lengths, token_budget: int, max_rows: int, pad_multiple: int, cache_tokens: int,
         stored_budget: int | None = None, packed: bool = False) -> list[Tree]:
    """``tree`` as trees that each fit one batch (children cut loose, leaves cut into pieces)."""
    if _fits(tree, lengths, token_budget, max_rows, pad_multiple, cache_tokens, stored_budget, packed):
        return [tree]
    out = []
    for child in tree.children:
        out += _fit(child, lengths, token_budget, max_rows, pad_multiple, cache_tokens, stored_budget, packed)
    piece: list[int] = []
    for i in sorted(tree.leaves, key=lambda i: -lengths[i]) + [None]:
        if i is not None:
            trial = Tree(tree.spine, leaves=piece + [i])
            if not piece or _fits(trial, lengths, token_budget, max_rows, pad_multiple, cache_tokens, stored_budget,
                                  packed):
                piece = trial.leaves
                continue
        out.append(Tree(tree.spine, leaves=piece))
        piece = [i] if i is not None else []
    return out


def _saves(piece: Tree, lengths, pad_multiple: int, packed: bool) -> bool:
    """True where a piece of a cut tree computes fewer tokens than its rows alone (each rounded up to
    ``pad_multiple`` as a plain batch pads it). ``find_trees`` weighed the whole tree unpadded; cut to fit a
    batch, each piece computes the spine again and, planned padded, pads its rows going on, so a piece of short
    rows can cost more than it saves (seen at --pad-multiple 64 with --max-batch-rows 2: 68,253 tokens computed
    against 59,328 without reuse). A packed piece of two rows or more always saves its spine."""
    alone = sum(lengths[i] if packed else round_up(lengths[i], pad_multiple) for i in piece.rows())
    return piece.cost(lengths, pad_multiple, packed=packed) < alone


def cut_prefix_batches(sequences, token_budget: int, max_rows: int, pad_multiple: int, min_prefix: int,
                       cache_tokens: int, forward_tokens: int = DEFAULT_PREFIX_FORWARD_TOKENS,
                       stored_budget: int | None = None, packed: bool = False) -> list[PlannedBatch]:
    """Batches over ``sequences`` with shared prefixes computed once; rows sharing none: ``cut_batches``.
    ``stored_budget``: the stored tokens a tree batch may hold (default the token budget; bench/prefix_waves.py
    models more). ``packed``: planned for workers that pack rows (the waves of gpu_worker/prefixrun.py): a
    group's rows going on are not padded, and rows sharing nothing fill the tree batches' room first (they ride
    in the waves' forwards), the rest cut as plain batches."""
    lengths = [len(s) for s in sequences]
    stored_budget = stored_budget or token_budget
    trees = [t for tree in find_trees(sequences, min_prefix, forward_tokens, packed)
             for t in _fit(tree, lengths, token_budget, max_rows, pad_multiple, cache_tokens, stored_budget, packed)
             if len(t.rows()) > 1 and _saves(t, lengths, pad_multiple, packed)]   # else its rows are computed alone
    grouped = {i for t in trees for i in t.rows()}
    alone_rows = sorted(set(range(len(sequences))) - grouped)

    def computed(ts: list[Tree]) -> int:
        return batch_computed(ts, lengths, pad_multiple, cache_tokens, forward_tokens, token_budget, packed)

    closed: list[list[Tree]] = []
    current: list[Tree] = []
    costs = {id(t): t.cost(lengths, pad_multiple, packed=packed) for t in trees}
    for tree in sorted(trees, key=lambda t: -costs[id(t)]):
        trial = current + [tree]
        fits = (sum(costs[id(t)] for t in trial) <= token_budget and computed(trial) <= token_budget
                and sum(len(t.rows()) for t in trial) <= max_rows
                and sum(lengths[i] for t in trial for i in t.rows()) <= stored_budget)
        if current and not fits:
            closed.append(current)
            current = []
        current.append(tree)
    if current:
        closed.append(current)
    riders: list[list[int]] = [[] for _ in closed]
    if packed:   # rows alone ride in a tree batch's waves where its budgets have room, longest first
        room = [[token_budget - computed(ts), stored_budget - sum(lengths[i] for t in ts for i in t.rows()),
                 max_rows - sum(len(t.rows()) for t in ts)] for ts in closed]
        for i in sorted(alone_rows, key=lambda i: -lengths[i]):
            for b, (compute, store, rows) in enumerate(room):
                if lengths[i] <= min(compute, store) and rows:
                    riders[b].append(i)
                    room[b] = [compute - lengths[i], store - lengths[i], rows - 1]
                    break
        rode = {i for r in riders for i in r}
        alone_rows = [i for i in alone_rows if i not in rode]
    batches: list[PlannedBatch] = []
    for ts, extra in zip(closed, riders, strict=True):
        members, groups = [], []
        for t in ts:
            groups += t.groups(len(members))
            members += t.rows()
        members += sorted(extra)
        padded_len = round_up(max(lengths[i] for i in members), pad_multiple)
        batches.append(PlannedBatch(members, padded_len, sum(lengths[i] for i in members), len(members) * padded_len,
                                    computed=computed(ts) + sum(lengths[i] for i in extra), groups=tuple(groups)))
    planned = cut_batches([lengths[i] for i in alone_rows], token_budget, max_rows, pad_multiple)
    batches += [PlannedBatch([alone_rows[j] for j in b.members], b.padded_len, b.tokens, b.padded) for b in planned]
    return batches
