"""What a tree batch's schedule buys (issue 40): a schedule model on the CPU, not a measurement.

    python bench/prefix_waves.py [--tokens 100000] [--forward-seconds 0.150] [--computed-tok-s 16980]
                                 [--packed-tok-s 16395] [--per-turn every-message|hsx|hsx,every-message]

Two runners of gpu_worker/prefixrun.py, their forwards counted by running them on a stand-in extractor:
- **padded** (a worker whose forward does not pack rows): each group's spine its own forward, the groups' rows
  going on merged under masks as the plan counts them, every forward's rows right-padded;
- **waves** (a packing worker, the default on a GPU with fla: ``_run_waves``): each forward one packed row of
  every spine piece whose parent is done, every row going on from a finished spine and every row alone, no
  padding. Without reuse such a worker runs each plain batch as one packed row of its stored tokens.
``--stored-multiple`` lets a tree batch store that many budgets of tokens (its computed tokens stay within one).

Each forward is priced max(its host work, its tokens at the measured rate): ``--forward-seconds`` (0.150 s,
bench/forward_host.py on the H100) and ``--computed-tok-s`` for padded rows (16,980: call F) or
``--packed-tok-s`` for packed ones (16,395: call AB's packed plain batches of this mix, 9.9 s). That reproduces
the measured off passes by construction; nothing else in it is measured, and it assumes no overlap of one
forward's host work with another's kernels (a host that never waits would do better).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_reuse import mixes, per_turn_cuts  # noqa: E402

from hsx.defaults import GROUPWISE_PREFIX_FORWARD_TOKENS  # noqa: E402
from hsx.prep import cut_batches, cut_prefix_batches  # noqa: E402


def waves(batch, seqs, budget: int) -> list[int]:
    """Tokens of each forward a packing worker runs for a tree batch: the worker's own ``_run_waves`` on a
    stand-in extractor (no model: each packed forward's tokens counted, its recorded states empty)."""
    from gpu_worker import kernels, prefixrun

    fed: list[int] = []

    def packed(ex, ids, cu, rows, states, put, record=()):
        lengths = [end - start for _, _, start, end in rows]
        fed.append(sum(lengths))
        bounds = [0, *itertools.accumulate(lengths)]
        pasts = types.SimpleNamespace(recorded={i: kernels.State(states[i], lengths[i]) for i in record})
        return (torch.zeros((bounds[-1], 1)), None), pasts, bounds

    rows = [torch.as_tensor(seqs[i], dtype=torch.int64) for i in batch.members]
    cu = [0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()]
    forest = prefixrun._forest(batch.groups, len(rows))
    grouped = {b for g in batch.groups for b in range(g.first, g.first + g.count)}
    put = prefixrun._Stored(torch.zeros((cu[-1], 1)), None)
    real = prefixrun._run_rows_packed
    prefixrun._run_rows_packed = packed
    try:   # the 27B's bound: 27 rows with states a forward at two budgets of cached tokens
        prefixrun._run_waves(None, torch.cat(rows), cu, forest, [b for b in range(len(rows)) if b not in grouped],
                             budget, 27, 2 * budget, put)
    finally:
        prefixrun._run_rows_packed = real
    return fed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--token-budget", type=int, default=32768)
    ap.add_argument("--forward-seconds", type=float, default=0.150)
    ap.add_argument("--computed-tok-s", type=float, default=16_980)
    ap.add_argument("--packed-tok-s", type=float, default=16_395)
    ap.add_argument("--prices", default="0,2560", help="--prefix-forward-tokens the plans are made at")
    ap.add_argument("--stored-multiple", default="1,4", help="budgets of stored tokens a tree batch may hold")
    ap.add_argument("--rows", default="padded,packed",
                    help="how the plans count a tree batch's rows (hsx produce --prefix-rows): padded, packed or both")
    ap.add_argument("--per-turn", default="every-message", type=per_turn_cuts,
                    help="how the agentic mix is cut (bench/prefix_reuse.py): hsx, every-message, or both")
    args = ap.parse_args()

    def seconds(forwards: list[int], rate: float) -> float:
        return sum(max(args.forward_seconds, t / rate) for t in forwards)

    with tempfile.TemporaryDirectory(prefix="hsx-prefix-waves-") as tmp:
        by_mix = mixes(args.tokens, Path(tmp), args.token_budget, args.per_turn)
    budget = args.token_budget
    print(f"{'mix':18s} {'rows':>6} {'price':>5} {'stored x':>8} {'schedule':>15} {'computed':>9} {'forwards':>8} {'model s':>7} "
          f"{'x off':>6}")
    for mix, seqs in by_mix.items():
        lengths = [len(s) for s in seqs]
        plain = cut_batches(lengths, budget, 512, 8)
        offs = {"padded": ([b.padded for b in plain], args.computed_tok_s),
                "waves": ([sum(lengths[i] for i in b.members) for b in plain], args.packed_tok_s)}
        for name, (fw, rate) in offs.items():
            print(f"{mix:18s} {'':>6} {'':>5} {'':>8} {'off, ' + name:>15} {sum(fw):>9,} {len(fw):>8} {seconds(fw, rate):>7.1f} "
                  f"{1:>6.2f}")
        for rows, multiple, price in itertools.product(args.rows.split(","),
                                                       (int(x) for x in args.stored_multiple.split(",")),
                                                       (int(x) for x in args.prices.split(","))):
            planned = stored_multiple(multiple, seqs, budget, price, rows)
            runs = {"padded": [], "padded, chooses": [], "waves": []}
            for b in planned:
                if not b.groups:
                    runs["padded"].append(b.padded)
                    runs["padded, chooses"].append(b.padded)
                    runs["waves"].append(sum(lengths[i] for i in b.members))
                    continue
                runs["waves"] += waves(b, seqs, budget)
                runs["padded"] += group_by_group(b, seqs, budget, price)
                runs["padded, chooses"] += group_by_group(b, seqs, budget, price, GROUPWISE_PREFIX_FORWARD_TOKENS)
            for name, fw in runs.items():
                off, rate = offs[name.split(",")[0]][0], offs[name.split(",")[0]][1]
                print(f"{mix:18s} {rows:>6} {price:>5} {multiple:>8} {name:>15} {int(sum(fw)):>9,} {len(fw):>8} "
                      f"{seconds(fw, rate):>7.1f} {seconds(off, rate) / seconds(fw, rate):>6.2f}")
    return 0


def group_by_group(batch, seqs, budget: int, price: int, choose: int = 0) -> list[int]:
    """Padded tokens of each forward the worker runs today (one a spine piece, the groups' rows going on merged
    as the plan counts them, the rows alone), counted by running the worker's own runner on a stand-in
    extractor (a model that takes a mask by row: the 27B's)."""
    fed: list[int] = []

    class Counting:
        device, width, hidden_size, store_final, out_dtype, model = torch.device("cpu"), 1, 1, False, torch.float32, None
        continues = packs = False   # the padded runner
        groupwise_price = choose    # > 0: a worker choosing trees or samples alone at that price (hsx worker's)

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


def stored_multiple(multiple: int, seqs, budget: int, price: int, rows: str = "padded"):
    """The producer's tree plan with a tree batch allowed ``multiple`` budgets of stored tokens, its rows
    counted ``rows`` (hsx produce --prefix-rows)."""
    return cut_prefix_batches(seqs, budget, 512, 8, 32, 2 * budget, price, stored_budget=multiple * budget,
                              packed=rows == "packed")


if __name__ == "__main__":
    sys.exit(main())
