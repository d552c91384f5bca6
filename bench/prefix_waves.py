"""What batching prefix groups across a batch would buy (issue 40): a schedule model on the CPU, not a measurement.

    python bench/prefix_waves.py [--tokens 100000] [--forward-seconds 0.150] [--computed-tok-s 16980]

The worker today runs a tree batch group by group (gpu_worker/prefixrun.py): each group's spine, then the rows
going on from it, one forward each. A "wave" schedule would run every piece of one depth of every tree of the
batch in one forward (each row continuing its own cached state: per-row Gated DeltaNet states through fla's
varlen kernels, keys and values under a mask), pieces sorted by length and split where a forward would pad a
piece to more than twice its length or pass the token budget. ``--stored-multiple`` lets a tree batch store that
many budgets of tokens (its computed tokens stay within one budget).

Each schedule is priced with the H100 rates measured by `bench/run_gpu.sh prefix` (call F: 16,980 computed
tok/s, ~0.150 s of host work a forward): a forward takes max(its host work, its tokens at that rate). It
reproduces the measured off pass (191,904 tokens, 7 forwards: 11.3 s) by construction; nothing else in it is
measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_reuse import mixes  # noqa: E402

from gpu_worker.prefixrun import _forest, _longest_holding_all, going_and_branching  # noqa: E402
from hsx.prep import cut_batches, cut_prefix_batches  # noqa: E402


def waves_of(batch, seqs) -> dict[int, list[int]]:
    """A tree batch's pieces by depth: (new tokens of) each spine beyond its parent's, each row going on."""
    lengths = [len(seqs[i]) for i in batch.members]
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    ids = torch.cat([torch.as_tensor(seqs[i]) for i in batch.members])
    waves: dict[int, list[int]] = {}

    def walk(node, depth: int, parent: int) -> None:
        spine = node[0].spine
        waves.setdefault(depth, []).append(spine - parent)
        going, branching = going_and_branching(ids, cu, node)
        for child in branching:
            walk(child, depth + 1, spine)
        waves.setdefault(depth + 1, []).extend(lengths[b] - spine for b in going)

    grouped = set()
    for node in _forest(batch.groups, len(lengths)):
        g = node[0]
        grouped.update(range(g.first, g.first + g.count))
        longest = _longest_holding_all(ids, cu, g)
        if longest is None:
            walk(node, 0, 0)
        else:
            waves.setdefault(0, []).append(lengths[longest])
    waves.setdefault(0, []).extend(lengths[m] for m in range(len(lengths)) if m not in grouped)
    return waves


def split(pieces: list[int], budget: int) -> list[int]:
    """Padded tokens of each forward of one wave: longest first, a new forward where the next piece would be
    padded past twice its length or the forward past the budget."""
    out, width, rows = [], 0, 0
    for n in sorted(pieces, reverse=True):
        if rows and ((rows + 1) * width > budget or n < width / 2):
            out.append(rows * width)
            rows = 0
        width, rows = (n, 1) if not rows else (width, rows + 1)
    return out + ([rows * width] if rows else [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--forward-seconds", type=float, default=0.150)
    ap.add_argument("--computed-tok-s", type=float, default=16_980)
    ap.add_argument("--prices", default="0,2560", help="--prefix-forward-tokens the plans are made at")
    ap.add_argument("--stored-multiple", default="1,4", help="budgets of stored tokens a tree batch may hold")
    args = ap.parse_args()

    def seconds(forwards: list[int]) -> float:
        return sum(max(args.forward_seconds, t / args.computed_tok_s) for t in forwards)

    with tempfile.TemporaryDirectory(prefix="hsx-prefix-waves-") as tmp:
        by_mix = mixes(args.tokens, Path(tmp), args.token_budget, "every-message")
    budget = args.token_budget
    print(f"{'mix':18s} {'price':>5} {'stored x':>8} {'schedule':>8} {'computed':>9} {'forwards':>8} {'model s':>7} {'x off':>6}")
    for mix, seqs in by_mix.items():
        lengths = [len(s) for s in seqs]
        off = [b.padded for b in cut_batches(lengths, budget, 512, 8)]
        print(f"{mix:18s} {'':>5} {'':>8} {'off':>8} {sum(off):>9,} {len(off):>8} {seconds(off):>7.1f} {1:>6.2f}")
        for multiple in (int(x) for x in args.stored_multiple.split(",")):
            for price in (int(x) for x in args.prices.split(",")):
                planned = stored_multiple(multiple, seqs, budget, price)
                now, waves = [], []
                for b in planned:
                    if not b.groups:
                        now.append(b.padded)
                        waves.append(b.padded)
                        continue
                    pieces = waves_of(b, seqs)
                    for depth in sorted(pieces):
                        waves += split(pieces[depth], budget)
                    now += group_by_group(b, seqs, budget, price)
                for name, fw in (("now", now), ("waves", waves)):
                    print(f"{mix:18s} {price:>5} {multiple:>8} {name:>8} {int(sum(fw)):>9,} {len(fw):>8} "
                          f"{seconds(fw):>7.1f} {seconds(off) / seconds(fw):>6.2f}")
    return 0


def group_by_group(batch, seqs, budget: int, price: int) -> list[int]:
    """Padded tokens of each forward the worker runs today (one a spine piece, the groups' rows going on merged
    as the plan counts them, the rows alone), counted by running the worker's own runner on a stand-in
    extractor (a model that takes a mask by row: the 27B's)."""
    fed: list[int] = []

    class Counting:
        device, width, hidden_size, store_final, out_dtype, model = torch.device("cpu"), 1, 1, False, torch.float32, None

        def forward_packed(self, ids, flat, n, cache=None, start=0, **_):
            fed.append(int(ids.numel()))
            return torch.zeros((n, 1)), None

    from gpu_worker import prefixrun

    rows = [torch.as_tensor(seqs[i], dtype=torch.int64) for i in batch.members]
    cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
    real = (prefixrun._cache_for, prefixrun._takes_row_pasts, prefixrun._merged_cache, prefixrun.row_pasts,
            prefixrun._rows_for_states)
    prefixrun._cache_for = lambda model: Cache()
    prefixrun._takes_row_pasts = lambda ex: True
    prefixrun._merged_cache = lambda ex, caches, counts, pasts: Cache()
    prefixrun.row_pasts = lambda ex, pasts, start, width: {}
    prefixrun._rows_for_states = lambda ex, cache_tokens: 0   # the 27B's bound (27 rows) is never reached here
    try:
        prefixrun.run_prefix_batch(Counting(), torch.cat(rows), cu, batch.groups, budget, 2 * budget, max(1, price))
    finally:
        (prefixrun._cache_for, prefixrun._takes_row_pasts, prefixrun._merged_cache, prefixrun.row_pasts,
         prefixrun._rows_for_states) = real
    return fed


class Cache:
    """Enough of a cache for the runner's bookkeeping (copies, expansion): no states."""

    def reorder_cache(self, index) -> None:
        pass


def stored_multiple(multiple: int, seqs, budget: int, price: int):
    """The producer's tree plan with a tree batch allowed ``multiple`` budgets of stored tokens."""
    return cut_prefix_batches(seqs, budget, 512, 8, 32, 2 * budget, price, stored_budget=multiple * budget)


if __name__ == "__main__":
    sys.exit(main())
