"""Shared prefixes computed once (issue 40): every stored sample equals a lone Hugging Face forward of it.

The runner (gpu_worker/prefixrun.py) on the tiny dense Qwen3 and the tiny Qwen3.5 hybrid (Gated DeltaNet +
attention), the planner (hsx/prep/prefixplan.py), and whole runs through produce -> worker -> uploader, fresh
and resumed. Tolerance: tests/test_reference.py's for float32 (atol 1e-5, rtol 1e-4). The negative test gives
a group's leaves another group's states and must see the check fail.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
import torch
from transformers import AutoModel

from gpu_worker import prefixrun
from gpu_worker.extractor import Extractor, cache_keyword
from hsx import life
from hsx.batch import batchfile
from hsx.life import ledger
from hsx.prep import PrefixGroup, cut_prefix_batches, find_groups
from hsx.store import open_store
from hsx_tools.demo import sample_dataset
from hsx_tools.prefixshare import expand_per_turn
from tests.pipeline import planned_specs, produce_config, run_pipeline, upload_config, worker_config
from tests.test_kernels import _tiny_hybrid

TOLERANCE = dict(atol=1e-5, rtol=1e-4)   # tests/test_reference.py, float32
# --prefix-forward-tokens for the tiny model's runs: its forwards cost little (the default, 2560, is the 27B's
# measured price, at which these few short rows make no tree)
TINY_FORWARD_TOKENS = 64
LAYERS = [0, 1, 3]


def _model(kind: str, tiny_model):
    if kind == "hybrid":
        return _tiny_hybrid()
    return AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def _batch(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat(rows), torch.tensor([0, *np.cumsum([len(r) for r in rows])])


def _lone_error(model, rows, hidden, final, cu) -> float:
    """Largest |stored - lone forward| over every sample, layers and final state; asserts the tolerance."""
    worst = 0.0
    for b, row in enumerate(rows):
        with torch.no_grad():
            out = model(input_ids=row.unsqueeze(0), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
        got = hidden[int(cu[b]):int(cu[b + 1])]
        worst = max(worst, float((got - want).abs().max()), float((final[int(cu[b]):int(cu[b + 1])]
                                                                    - out.last_hidden_state[0]).abs().max()))
        torch.testing.assert_close(got, want, **TOLERANCE, msg=f"sample {b}")
        torch.testing.assert_close(final[int(cu[b]):int(cu[b + 1])], out.last_hidden_state[0], **TOLERANCE)
    return worst


def _rows(seed: int, vocab: int = 200):
    """Two groups (spines of 70 and 45 tokens: mid-chunk for the GDN's 64-token chunks), two rows alone (branch
    point 0), three turns of a conversation that branch (a group of spine 35 holding one of spine 61 that
    continues its states: two rows going on from there) and a chain from token 0 (three tool-call steps, each a
    prefix of the next: run as its longest row alone). Group A holds its spine itself (a strict
    prefix of the others) and a one-token leaf."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g)   # noqa: E731
    a, b = rand(70), rand(45)
    rows = [torch.cat([a, rand(n)]) for n in (0, 5, 30, 1)] + [torch.cat([b, rand(n)]) for n in (9, 12)]
    rows += [rand(33), rand(64)]
    turns = rand(35)
    rows += [turns, torch.cat([turns, rand(26)])]                # 8: the first turn; 9: the second (61)
    rows += [torch.cat([rows[9], rand(9)]), torch.cat([rows[9], rand(4)])]   # 10, 11: two third turns
    steps = rand(20)
    for n in (0, 10, 8):
        steps = torch.cat([steps, rand(n)])
        rows.append(steps)                                       # 12, 13, 14: the chain
    groups = [PrefixGroup(0, 4, 70), PrefixGroup(4, 2, 45), PrefixGroup(8, 4, 35), PrefixGroup(9, 3, 61),
              PrefixGroup(12, 3, 20), PrefixGroup(13, 2, 30)]
    return rows, groups


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("chunk_tokens,packed", [(4096, False), (16, False), (4096, True), (16, True)])
def test_every_sample_equals_its_lone_forward(kind, chunk_tokens, packed, tiny_model, monkeypatch):
    """16: each spine longer than the piece a forward may take. packed: the fused kernels (the reference set) and
    the rows computed alone packed into one row, as a packing worker runs them."""
    model = _model(kind, tiny_model)
    real_packed = prefixrun._run_rows_packed
    if packed:
        from gpu_worker import kernels
        from tests.test_kernels import _reference

        reference = _reference(model)
        monkeypatch.setattr(kernels, "choose", lambda mode, device: (reference, ""))
        forwards = []   # each packed forward: (its rows, (row, start, end) of the spine pieces it records)

        def packed_rows(ex_, ids_, cu_, rows_, states, put, record=()):
            forwards.append(([b for b, _, _, _ in rows_], [rows_[i][0:1] + rows_[i][2:] for i in record]))
            return real_packed(ex_, ids_, cu_, rows_, states, put, record)
        monkeypatch.setattr(prefixrun, "_run_rows_packed", packed_rows)
        monkeypatch.setattr(prefixrun, "_merged_cache", None)   # the padded way of rows going on: not taken
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    assert ex.packs == packed
    rows, groups = _rows(1)
    ids, cu = _batch(rows)
    hidden, final = ex.run_shared(ids, cu, [list(g) for g in groups], chunk_tokens)
    worst = _lone_error(model, rows, hidden, final, cu)
    print(f"{kind}, pieces of {chunk_tokens}: max |reused - lone| = {worst:.2e}")
    if packed and chunk_tokens == 4096:   # in waves: a forward a depth of the trees
        assert forwards == [
            ([0, 4, 8, 14, 6, 7], [(0, 0, 70), (4, 0, 45), (8, 0, 35)]),   # the spines from 0, the chain, the rows alone
            ([1, 2, 3, 4, 5, 9], [(9, 35, 61)]),   # A's and B's leaves, the second turn's spine from the first's states
            ([10, 11], []),                       # the third turns, from the second's
        ], forwards
    elif packed:   # a spine longer than a forward's 16 tokens: recorded piece by piece, each from the last's states
        assert [(0, 0, 16), (0, 16, 32), (0, 32, 48), (0, 48, 64), (0, 64, 70)] == [
            piece for _, recorded in forwards for piece in recorded if piece[0] == 0]
        assert all(sum(ids_[2] - ids_[1] for ids_ in recorded) <= 16 for _, recorded in forwards)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
@pytest.mark.parametrize("packed", [False, True])
def test_a_leaf_continued_from_another_rows_state_fails_the_check(kind, packed, tiny_model, monkeypatch):
    """The check above can fail: group B's leaves continue from group A's states at its branch point (both
    spines 40 tokens, two leaves each), everything else as in a real batch; packed: the leaves in one packed
    row, each from the states its group hands it (here A's for B's)."""
    model = _model(kind, tiny_model)
    if packed:
        from gpu_worker import kernels
        from tests.test_kernels import _reference

        reference = _reference(model)
        monkeypatch.setattr(kernels, "choose", lambda mode, device: (reference, ""))
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    assert ex.packs == packed
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, 200, (n,), generator=g)   # noqa: E731
    a, b = rand(40), rand(40)
    rows = [torch.cat([a, rand(n)]) for n in (7, 3)] + [torch.cat([b, rand(n)]) for n in (6, 11)]
    ids, cu = _batch(rows)
    if packed:   # the leaves run in one packed forward: each of B's gets A's states (both spines end at 40)
        from gpu_worker import kernels

        real_pasts = kernels.Pasts

        def leaves_from_group_a(states, *a, **k):
            first = next((s for s in states if s is not None), None)
            return real_pasts([first if s is not None else None for s in states], *a, **k)
        target, name, real = kernels, "Pasts", real_pasts
    else:
        real_add, first = prefixrun._Going.add, []

        def leaves_from_group_a(going, cache, past, rows_):
            if not first:
                first.append(cache)   # group A's states at its branch point
            real_add(going, first[0], past, rows_)
        target, name, real = prefixrun._Going, "add", real_add

    monkeypatch.setattr(target, name, leaves_from_group_a)
    hidden, final = ex.run_shared(ids, cu, [[0, 2, 40], [2, 2, 40]], 4096)
    with pytest.raises(AssertionError, match="sample 2"):
        _lone_error(model, rows, hidden, final, cu)
    monkeypatch.setattr(target, name, real)   # the same batch, untouched, passes
    _lone_error(model, rows, *ex.run_shared(ids, cu, [[0, 2, 40], [2, 2, 40]], 4096), cu)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_chain_of_prefixes_runs_as_one_row(kind, tiny_model, monkeypatch):
    """Tool-call steps cut one a sample are prefixes of each other: the chain is its longest row, run with its
    parent's leaves (or alone at the top), each shorter member a slice of it, exact."""
    model = _model(kind, tiny_model)
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    g = torch.Generator().manual_seed(4)
    rand = lambda n: torch.randint(0, 200, (n,), generator=g)   # noqa: E731
    shared, chain = rand(40), rand(30)
    rows = [torch.cat([shared, rand(9)])]
    for n in (0, 13, 21):                    # three steps, each a prefix of the next, after the shared prompt
        chain = torch.cat([chain, rand(n)])
        rows.append(torch.cat([shared, chain]))
    rows.append(torch.cat([shared, chain[:30], rand(7)]))     # branches inside the chain: not a prefix of it
    ids, cu = _batch(rows)
    groups = [[0, 5, 40], [1, 4, 70], [2, 2, 83]]
    forwards = []
    real = ex.forward_packed
    monkeypatch.setattr(ex, "forward_packed", lambda ids_, *a, **k: forwards.append(ids_.shape) or real(ids_, *a, **k))
    hidden, final = ex.run_shared(ids, cu, groups, 4096)
    _lone_error(model, rows, hidden, final, cu)
    # the spine (40); the group of 70's spine (30 more); then one forward of the rows going on: the chain
    # [2, 2, 83] as its longest row (104 - 70 = 34 tokens; without the collapse a spine of 13, then a leaf of 21)
    # beside the leaf that branched (7), both from the 70's states, and the top group's leaf (9) from the 40's
    # (pasts of two lengths in one forward). Nesting every step would take 6 forwards, one a group's rows 4.
    assert forwards == [(1, 40), (1, 30), (3, 34)], forwards


class _Decoder(torch.nn.Module):
    """A decoder whose forward takes its cache by ``keyword`` (transformers 5.17 calls it ``past_key_values``, a
    newer one ``cache``) and hands it to the real one; ``drop``: it takes the keyword and forgets it."""

    def __init__(self, real, keyword: str, drop: bool = False):
        super().__init__()
        self.real, self.keyword, self.drop = real, keyword, drop
        self.layers = real.layers

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        if self.keyword == "cache" and "cache" in kwargs:
            past_key_values = kwargs.pop("cache")
        if not self.drop:   # the real decoder's own keyword (as this transformers names it)
            takes = inspect.signature(self.real.forward).parameters
            kwargs["cache" if "cache" in takes else "past_key_values"] = past_key_values
        return self.real(input_ids=input_ids, **kwargs)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_the_cache_goes_by_the_keyword_the_models_forward_takes(kind, tiny_model):
    """transformers 5.17 (the H200 image's) takes ``past_key_values``, and its forward swallows an unknown
    ``cache=`` in ``**kwargs``: passed that way, every leaf was computed without its prefix (rel error ~1)."""
    model = _model(kind, tiny_model)
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    ex.decoder = _Decoder(ex.decoder, "past_key_values")
    assert cache_keyword(ex.decoder) == "past_key_values"
    rows, groups = _rows(3)
    ids, cu = _batch(rows)
    _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096), cu)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_model_that_does_not_continue_the_cache_is_refused_not_stored_wrong(kind, tiny_model):
    model = _model(kind, tiny_model)
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    ex.decoder = _Decoder(ex.decoder, "past_key_values", drop=True)
    rows, groups = _rows(3)
    ids, cu = _batch(rows)
    with pytest.raises(RuntimeError, match="did not continue the shared prefix"):
        ex.run_shared(ids, cu, [list(g) for g in groups], 4096)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_plain_forward_skips_transformers_packed_rows_check_and_stores_the_same(kind, tiny_model, monkeypatch):
    """transformers' packed-rows check ends in a GPU -> host sync at every cache-less forward; hsx's rows are
    never packed, so the extractor answers it (None) without computing it. The stored rows are bit-equal to the
    forward with the check, the check is never reached inside ``run``, and it is back in place afterwards."""
    from transformers import masking_utils

    from gpu_worker.extractor import pad_batch

    model = _model(kind, tiny_model)
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    rows, _ = _rows(5)
    ids, cu = _batch(rows)
    batch = pad_batch(ids, cu, max(len(r) for r in rows), 0, pin=False)
    real_check, calls = masking_utils.find_packed_sequence_indices, []

    def counted(position_ids):
        calls.append(position_ids.shape)
        return real_check(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counted)
    hidden, final = (t.clone() for t in ex.run(batch))
    assert calls == [] and masking_utils.find_packed_sequence_indices is counted
    with torch.no_grad():   # the same decoder with the check in place: it is asked, and answers None
        want = model(input_ids=batch.input_ids, output_hidden_states=True, use_cache=False)
    assert len(calls) >= 1
    flat = batch.flat_index
    torch.testing.assert_close(hidden, torch.cat([want.hidden_states[i + 1].reshape(-1, hidden.shape[1] // len(LAYERS))
                                                  [flat] for i in LAYERS], dim=-1), atol=0, rtol=0)
    torch.testing.assert_close(final, want.last_hidden_state.reshape(-1, final.shape[1])[flat], atol=0, rtol=0)
    _lone_error(model, rows, hidden, final, cu)


def test_a_model_whose_forward_takes_no_cache_is_refused_by_name():
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return input_ids

    with pytest.raises(TypeError, match="NoCache.forward takes no cache.*--prefix-reuse off"):
        cache_keyword(NoCache())


class _CacheOf517:
    """transformers 5.17's cache API (the H200 image's): a DynamicCache without ``is_recording_past`` and
    ``get_recurrent_state``, which a newer transformers added. Copies and attributes set go to the cache inside."""

    def __init__(self, cache):
        object.__setattr__(self, "_cache", cache)

    def __getattr__(self, name):
        if name in ("is_recording_past", "get_recurrent_state"):
            raise AttributeError(name)
        return getattr(self._cache, name)

    def __setattr__(self, name, value):
        setattr(self._cache, name, value)

    def __copy__(self):
        import copy

        return _CacheOf517(copy.copy(self._cache))

    def __deepcopy__(self, memo):
        import copy

        return _CacheOf517(copy.deepcopy(self._cache, memo))


@pytest.mark.parametrize("chunk_tokens,cache_api", [(4096, "this"), (16, "this"), (4096, "5.17"), (16, "5.17")])
def test_the_fused_gated_deltanet_continues_a_cache_exactly(chunk_tokens, cache_api, monkeypatch):
    """gpu_worker/kernels.py's forwards (reference kernels: the fused maths in torch) with spines and leaves: the
    fused GDN reads and writes the cached conv window and recurrent state (every GDN call of the batch is fused,
    none falls back), through this transformers' cache and through 5.17's API. Tolerance: tests/test_kernels.py's
    for the fused glue against transformers (2e-5)."""
    from gpu_worker import kernels, prefixrun
    from gpu_worker.extractor import _decoder
    from tests.test_kernels import _counting, _reference

    if cache_api == "5.17":
        made = prefixrun._cache_for
        monkeypatch.setattr(prefixrun, "_cache_for", lambda model: _CacheOf517(made(model)))

    model = _tiny_hybrid()
    lone = _tiny_hybrid()   # the same weights (seed 0), transformers' own forward
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    calls: dict = {}
    counts = kernels.install(_decoder(model), _counting(_reference(model), calls))
    assert counts["gated_deltanet"] == 3 and counts["norm"] > 0
    eager_calls = []
    for m in _decoder(model).modules():
        if hasattr(m, "_hsx_eager") and type(m).__name__ in kernels.GATED_DELTANETS:
            m._hsx_eager = (lambda f: lambda *a, **k: eager_calls.append(1) or f(*a, **k))(m._hsx_eager)
    rows, groups = _rows(4)
    ids, cu = _batch(rows)
    merged, real_merged = [], prefixrun._merged_cache
    monkeypatch.setattr(prefixrun, "_merged_cache", lambda *a: merged.append(len(a[1])) or real_merged(*a))
    hidden, final = ex.run_shared(ids, cu, [list(g) for g in groups], chunk_tokens, 8192)   # the cache of a 4k budget
    # a 4k budget: rows of several groups' states in one forward, through this cache API (16: one group a forward)
    assert (max(merged) > 1) == (chunk_tokens > 16), merged
    # 7 forwards at least: the spines of groups A and B, of the turns (35) and of the 61 that continues them; the
    # rows going on from all four (one forward, each row from its group's states); the chain's longest row; the
    # rows alone
    assert not eager_calls and calls["gated_delta_rule"] >= 3 * 7
    for b, row in enumerate(rows):
        with torch.no_grad():
            out = lone(input_ids=row.unsqueeze(0), output_hidden_states=True)
        want = torch.cat([out.hidden_states[i + 1][0] for i in LAYERS], dim=-1)
        torch.testing.assert_close(hidden[int(cu[b]):int(cu[b + 1])], want, rtol=2e-5, atol=2e-5)


def test_a_group_whose_rows_do_not_share_the_spine_is_refused(tiny_model):
    ex = Extractor(_model("dense", tiny_model), LAYERS, store_final=True, out_dtype="float32")
    rows, _ = _rows(3)
    ids, cu = _batch(rows)
    with pytest.raises(ValueError, match="do not share the spine"):
        ex.run_shared(ids, cu, [[3, 3, 40]], 4096)


# ---- the plan -------------------------------------------------------------------------------------------------

def _seqs(seed=0):
    rng = np.random.default_rng(seed)
    system = list(rng.integers(0, 500, 400))
    convs = []
    for _conv in range(6):                   # 6 conversations of one system prompt, 4 turns each (per-turn rows)
        history = system + list(rng.integers(0, 500, 50))
        for _ in range(4):
            history = history + list(rng.integers(0, 500, int(rng.integers(100, 300))))
            convs.append(list(history))
    convs += [list(rng.integers(0, 500, int(n))) for n in rng.integers(5, 200, 10)]   # rows sharing nothing
    return convs


def test_the_plan_computes_each_spine_once_and_counts_what_it_computes():
    seqs = _seqs()
    planned = cut_prefix_batches(seqs, 4096, 64, 8, 16, 8192)
    members = sorted(i for b in planned for i in b.members)
    assert members == list(range(len(seqs)))                      # every row once
    stored = sum(len(s) for s in seqs)
    computed = sum(b.computed for b in planned)
    for b in planned:
        assert b.computed <= 4096 and len(b.members) <= 64            # the budget counts computed tokens,
        assert b.tokens <= 4096                                       # and stored ones (the worker's buffers)
        for g in b.groups:
            rows = [seqs[b.members[k]] for k in range(g.first, g.first + g.count)]
            assert g.spine >= 16 and all(r[:g.spine] == rows[0][:g.spine] for r in rows)
    assert computed < 0.5 * stored, (computed, stored)
    # per conversation: its turns share their whole common history, more than the system prompt alone
    assert max(g.spine for b in planned for g in b.groups) > 600
    print(f"plan: {stored} tokens stored, {computed} computed")


@pytest.mark.parametrize("price", [1, 200])   # 200: groups' rows going on merge, padded to the longest
def test_the_worker_computes_what_the_plan_counted(price, tiny_model, monkeypatch):
    """A batch's budget counts its computed tokens, so the worker must feed no more than the plan counted: chains
    from token 0 and under a spine, branching turns, leaves, and (at a price of 200 tokens a forward) the rows
    going on from several groups in one forward. Every planned tree batch of per-turn rows (each turn a prefix of
    the next, and a conversation that branches) is run and its forwards' tokens (rows x width, padding in) and
    forwards counted; every sample stays exact. ``groupwise_costs`` counts the same forwards before they run (a
    group-by-group worker's choice of trees or samples alone rests on it), and a worker whose forwards cost more
    than the trees save (``groupwise_price``) runs the samples alone, as counted, still exact."""
    from gpu_worker.prefixrun import groupwise_costs

    rng = np.random.default_rng(5)
    ids = lambda n: list(rng.integers(0, 200, n))   # noqa: E731
    system, seqs = ids(120), []
    for _conv in range(3):                             # chains under the system prompt
        history = system + ids(20)
        for _ in range(3):
            history = history + ids(int(rng.integers(30, 90)))
            seqs.append(list(history))
    steps = ids(60)                                    # a chain from token 0
    for n in (25, 40):
        steps = steps + ids(n)
        seqs.append(list(steps))
    turn = system + ids(40)                            # a conversation whose third turn branches
    seqs += [turn + ids(30), turn + ids(30) + ids(50), turn + ids(35)]
    for n in (400, 550, 700):                          # conversations of other lengths whose last turns branch
        history = ids(n)
        seqs += [history + ids(int(rng.integers(20, 60))) for _ in range(3)]
    model = _model("dense", tiny_model)
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    fed, masked, real = [], [], ex.forward_packed
    monkeypatch.setattr(ex, "forward_packed", lambda x, *a, **k: fed.append(x.numel()) or masked.append(
        "attention_mask" in k) or real(x, *a, **k))
    trees = [b for b in cut_prefix_batches(seqs, 2048, 64, 1, 16, 8192, forward_tokens=price) if b.groups]
    assert len(trees) >= 1
    ran_alone = 0
    for b in trees:
        rows = [torch.tensor(seqs[i]) for i in b.members]
        batch_ids, cu = _batch(rows)
        fed.clear()
        hidden, final = ex.run_shared(batch_ids, cu, [list(g) for g in b.groups], 2048, 8192, price)
        assert sum(fed) == b.computed, (b.groups, fed, b.computed)
        _lone_error(model, rows, hidden, final, cu)
        by_trees, by_alone = groupwise_costs(ex, batch_ids, cu, [PrefixGroup(*g) for g in b.groups], 2048, 8192, price)
        assert fed == by_trees and sum(by_alone) > sum(by_trees), (fed, by_trees, by_alone)
        # priced by tokens alone the trees win; by forwards alone the fewer forwards do (a tie: alone)
        for ex.groupwise_price, runs in ((1, by_trees), (10**6, by_alone if len(by_trees) >= len(by_alone) else by_trees)):
            fed.clear()
            _lone_error(model, rows, *ex.run_shared(batch_ids, cu, [list(g) for g in b.groups], 2048, 8192, price), cu)
            assert fed == runs, (ex.groupwise_price, fed, runs)
        ran_alone += len(by_trees) > len(by_alone)
        ex.groupwise_price = 0
    assert ran_alone, "no tree batch of more forwards than its samples alone: the choice was not tried"
    assert any(masked) == (price > 1), masked   # rows of groups with different pasts in one forward


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_packed_plan_keeps_every_leaf_and_each_runner_computes_it_exactly(kind, tiny_model, monkeypatch):
    """--prefix-rows packed: a group's rows going on are not padded, so every leaf of a spine is kept, however its
    length differs from the others' (a padded plan keeps the range of lengths that pays for its padding), and rows
    sharing nothing ride in the tree batches where their budgets have room. A packing worker's waves compute
    exactly the tokens the plan counted; a worker that pads runs the same batch with no forward over the budget
    (a group's rows cut longest first: ``row_pieces``). Every sample equals its lone forward on both."""
    from gpu_worker import kernels
    from gpu_worker.prefixrun import row_pieces
    from tests.test_kernels import _reference

    rng = np.random.default_rng(3)
    ids = lambda n: list(rng.integers(0, 200, n))   # noqa: E731
    system = ids(150)
    seqs = [system + ids(n) for n in (12, 40, 25, 700, 30)] + [ids(n) for n in (90, 60, 300, 35)]
    padded = find_groups(seqs, 16, 1)
    packed = find_groups(seqs, 16, 1, packed=True)
    assert packed == [([0, 1, 2, 3, 4], 150)] and padded and 3 not in padded[0][0], (packed, padded)
    budget = 1200
    planned = cut_prefix_batches(seqs, budget, 64, 8, 16, 2 * budget, 1, stored_budget=2 * budget, packed=True)
    assert sorted(i for b in planned for i in b.members) == list(range(len(seqs)))   # every row once
    tree = next(b for b in planned if b.groups)
    riders = tree.members[5:]
    assert tree.members[:5] == [0, 1, 2, 3, 4] and riders and all(i >= 5 for i in riders)
    assert tree.computed == 150 + (12 + 40 + 25 + 700 + 30) + sum(len(seqs[i]) for i in riders) <= budget
    assert all(b.tokens <= 2 * budget and b.computed <= budget for b in planned)

    model = _model(kind, tiny_model)
    rows = [torch.tensor(seqs[i]) for i in tree.members]
    batch_ids, cu = _batch(rows)
    groups = [list(g) for g in tree.groups]
    pads = Extractor(model, LAYERS, store_final=True, out_dtype="float32")   # the padded runner, group by group
    fed, real = [], pads.forward_packed
    monkeypatch.setattr(pads, "forward_packed", lambda x, *a, **k: fed.append(x.numel()) or real(x, *a, **k))
    _lone_error(model, rows, *pads.run_shared(batch_ids, cu, groups, budget, 2 * budget, 1), cu)
    assert fed and max(fed) <= budget, fed   # 5 rows going on x 700 would be 3,500 in one forward
    assert row_pieces([700, 30, 12], 800, 0) == [[0], [1, 2]] and row_pieces([30, 12], 800, 1) == [[0], [1]]
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (_reference(model), ""))
    waves = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    assert waves.continues
    before = waves.tokens_fed
    _lone_error(model, rows, *waves.run_shared(batch_ids, cu, groups, budget, 2 * budget, 1), cu)
    assert waves.tokens_fed - before == tree.computed


def test_merged_forwards_pays_only_where_the_padding_costs_less_than_a_forward(monkeypatch):
    """The rows going on from groups (past, lengths after it) are merged largest first: a group joins where its
    padding is under the price, the forward within the budget and its keys within the cache; a model that takes
    no mask by row merges only one past length; groups are held in segments of at most MAX_HELD."""
    from hsx.prep import prefixplan

    entries = [(100, [50, 40]), (300, [48]), (200, [10]), (100, [49, 45])]
    # largest first: 0 (50), 3 (49: pads 6), 1 (48: pads 2) together; 2 (10) would pad 40, over a price of 30
    assert prefixplan.merged_forwards(entries, 10_000, 30, 4096) == [[[0, 3, 1], [2]]]
    assert prefixplan.merged_forwards(entries, 10_000, 100, 4096) == [[[0, 3, 1, 2]]]
    assert prefixplan.merged_forwards(entries, 10_000, 30, 4096, mixed_pasts=False) == [[[0, 3], [1], [2]]]
    # a budget of 150 tokens a forward (rows x longest row): 3 cannot join 0 (4 x 50), 1 can (3 x 50), 2 joins 3
    assert prefixplan.merged_forwards(entries, 10_000, 100, 150) == [[[0, 1], [3, 2]]]
    # 700 cached tokens (rows x (longest past + longest row)): 1 cannot join 0 and 3 (5 x 350), 2 joins 1 (2 x 348)
    assert prefixplan.merged_forwards(entries, 700, 100, 4096) == [[[0, 3], [1, 2]]]
    monkeypatch.setattr(prefixplan, "MAX_HELD", 2)   # two groups held at most: segments [0, 1] and [2, 3]
    assert prefixplan.merged_forwards(entries, 10_000, 100, 4096) == [[[0, 1]], [[3, 2]]]
    assert prefixplan.merged_forwards(entries, 450, 100, 4096) == [[[0], [1]], [[3], [2]]]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_groups_held_in_segments_and_a_model_without_masks_by_row_stay_exact(kind, tiny_model, monkeypatch):
    """Two groups a segment at most (their rows going on run when the segment's groups are done), and a model
    whose forward takes no mask by row (only rows of one past length merged): every sample exact."""
    from hsx.prep import prefixplan

    model = _model(kind, tiny_model)
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    rows, groups = _rows(6)
    ids, cu = _batch(rows)
    shapes, real = [], ex.forward_packed
    monkeypatch.setattr(ex, "forward_packed", lambda x, *a, **k: shapes.append(("mask" in str(k.keys()), x.shape))
                        or real(x, *a, **k))
    merged, real_merged = [], prefixrun._merged_cache
    monkeypatch.setattr(prefixrun, "_merged_cache", lambda *a: merged.append(len(a[1])) or real_merged(*a))
    _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096), cu)
    assert merged == [3], merged   # the three groups with rows going on (A, B, the 61), in one forward
    merged.clear()
    monkeypatch.setattr(prefixplan, "MAX_HELD", 2)
    _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096), cu)
    assert sorted(merged) == [1, 2], merged   # two groups held, then the third
    assert any(masked for masked, _ in shapes), shapes
    monkeypatch.setattr(prefixrun, "_takes_row_pasts", lambda ex_: False)
    shapes.clear()
    _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096), cu)
    assert not any(masked for masked, _ in shapes), shapes


def test_a_forward_continues_no_more_rows_than_their_gdn_states_may_hold(monkeypatch):
    """The Gated DeltaNet states of a forward's rows stay within the bytes of the plan's cached tokens (the 27B:
    ~151 MB a row, 27 rows at 65,536 tokens): a planned forward of more rows runs as several, exact. A model
    without GDN layers has no such bound."""
    from bench.shapes import make_config

    assert prefixrun.rows_for_states(make_config("hybrid27b"), 65_536, 2) == 27
    assert prefixrun.rows_for_states(make_config("qwen3-8b"), 65_536, 2) == 0
    model = _tiny_hybrid()
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    rows, groups = _rows(8)
    ids, cu = _batch(rows)
    monkeypatch.setattr(prefixrun, "rows_for_states", lambda config, cache_tokens, dtype_bytes: 2)
    cached, real = [], ex.forward_packed
    monkeypatch.setattr(ex, "forward_packed", lambda x, *a, **k: (k.get("cache") is not None and cached.append(
        x.shape[0])) or real(x, *a, **k))
    _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096), cu)
    assert cached and max(cached) == 2, cached


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_waves_keep_their_bounds_and_stay_exact(kind, tiny_model, monkeypatch):
    """A packing worker's waves: at most ``max_rows`` samples with states a forward and at most ``cache_tokens``
    keys read (pasts and own tokens); tight bounds (MAX_HELD at 1 too) only make more forwards, every sample still
    equal to its lone forward, and each continued state's Gated DeltaNet states dropped once its rows ran."""
    from gpu_worker import kernels
    from tests.test_kernels import _reference

    model = _model(kind, tiny_model)
    reference = _reference(model)
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (reference, ""))
    ex = Extractor(model, LAYERS, store_final=True, out_dtype="float32")
    assert ex.continues
    rows, groups = _rows(5)
    ids, cu = _batch(rows)
    seen, continued, real_packed = [], {}, prefixrun._run_rows_packed

    def packed_rows(ex_, ids_, cu_, rows_, states, put, record=()):
        stateful = sum(s is not None or i in record for i, s in enumerate(states or [None] * len(rows_)))
        seen.append((stateful, sum(end for _, _, _, end in rows_), len(rows_), sum(e - s for _, _, s, e in rows_)))
        continued.update({id(s): s for s in states or () if s is not None})
        return real_packed(ex_, ids_, cu_, rows_, states, put, record)

    monkeypatch.setattr(prefixrun, "_run_rows_packed", packed_rows)
    fed = ex.tokens_fed
    wide = _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096), cu)
    forwards_wide = len(seen)
    # what the worker counts as computed: each piece's tokens once, fewer than the samples hold
    assert ex.tokens_fed - fed == sum(n for *_, n in seen) < int(cu[-1])
    monkeypatch.setattr(prefixrun, "rows_for_states", lambda config, cache_tokens, dtype_bytes: 2)
    monkeypatch.setattr(prefixrun, "MAX_HELD", 1)
    seen.clear()
    tight = _lone_error(model, rows, *ex.run_shared(ids, cu, [list(g) for g in groups], 4096, cache_tokens=140), cu)
    assert len(seen) > forwards_wide
    assert all(stateful <= 2 for stateful, _, _, _ in seen), seen
    assert all(keys <= 140 or n == 1 for _, keys, n, _ in seen), seen   # a forward of one sample may read more
    # every state some row continued has dropped its GDN states by the batch's end (each once all its rows ran)
    assert continued and all(s.conv is None and s.recurrent is None for s in continued.values())
    print(f"{kind}: {forwards_wide} forwards wide, {len(seen)} tight; max |reused - lone| {wide:.1e} / {tight:.1e}")


def test_rows_going_on_that_were_never_run_are_refused_not_stored(tiny_model, monkeypatch):
    """The worker runs the rows going on as the plan's segments fill; if its groups and the plan's entries ever
    disagree, rows would be left unwritten (uninitialised memory stored as hidden states): refused instead."""
    ex = Extractor(_model("dense", tiny_model), LAYERS, store_final=True, out_dtype="float32")
    rows, groups = _rows(7)
    ids, cu = _batch(rows)
    real = prefixrun.merged_forwards
    monkeypatch.setattr(prefixrun, "merged_forwards", lambda entries, *a, **k: real(entries + [(5, [1])], *a, **k))
    with pytest.raises(RuntimeError, match="were not run"):
        ex.run_shared(ids, cu, [list(g) for g in groups], 4096)


def test_a_group_too_large_for_one_batch_recomputes_its_spine_in_each():
    seqs = [[7] * 300 + [i, i + 1] * 20 for i in range(20)]        # 20 rows, spine 300, leaves 40
    planned = cut_prefix_batches(seqs, 3000, 64, 8, 16, 10_000)
    assert len(planned) > 1 and all(b.groups and b.computed <= 3000 and b.tokens <= 3000 for b in planned)
    assert all(g.spine == 300 for b in planned for g in b.groups)
    assert sum(b.computed for b in planned) == 300 * len(planned) + 20 * 40


def test_a_piece_of_a_cut_tree_whose_padding_outweighs_its_spine_is_computed_alone():
    """Cut into pieces of two rows (--max-batch-rows 2) and padded to 64, a spine of 40 with 1-4 token leaves
    costs 40 + 2 x 64 a piece where its two rows alone cost 2 x 64: every piece goes, where the whole tree (weighed
    unpadded) pays. Before, such a plan computed more than no reuse (an outside check: 68,253 against 59,328)."""
    seqs = [[7] * 40 + [i] * (1 + i % 4) for i in range(20)] + [[9] * 200 + [i] * 100 for i in range(4)]
    planned = cut_prefix_batches(seqs, 1024, 2, 64, 16, 8192, 1)
    plain = cut_prefix_batches(seqs, 1024, 2, 64, 10_000, 8192, 1)   # a threshold no row shares: no reuse
    assert not any(g.spine == 40 for b in planned for g in b.groups)   # the short rows' pieces: alone
    assert [g.spine for b in planned for g in b.groups] == [200, 200]  # the long rows' pieces still save
    assert sum(b.computed or b.padded for b in planned) < sum(b.padded for b in plain)
    assert sorted(i for b in planned for i in b.members) == list(range(len(seqs)))


def test_a_tree_batch_stores_at_most_its_stored_budget():
    """``stored_budget`` (bench/prefix_waves.py's model of larger tree batches) lets a batch of trees store more
    than it computes; without it stored tokens stay within the token budget."""
    seqs = [[7] * 300 + [i, i + 1] * 20 for i in range(20)]        # 20 rows, 6,800 stored, 1,100 computed
    one = cut_prefix_batches(seqs, 3000, 64, 8, 16, 10_000)
    four = cut_prefix_batches(seqs, 3000, 64, 8, 16, 10_000, stored_budget=12_000)
    assert all(b.tokens <= 3000 for b in one) and len(one) > 1
    assert len(four) == 1 and four[0].tokens == 6800 and four[0].computed == 300 + 20 * 40 <= 3000


def test_rows_sharing_less_than_the_threshold_stay_alone():
    seqs = [[1] * 10 + [i] * 50 for i in range(5)]
    assert find_groups(seqs, 16) == []
    assert all(not b.groups for b in cut_prefix_batches(seqs, 4096, 64, 8, 16, 8192))


def test_a_tree_is_planned_only_where_it_saves_more_than_its_forwards_cost():
    """The price of a forward (--prefix-forward-tokens; the default 512): six rows sharing 90 tokens save 450
    tokens for their spine's forward, planned at a price of 64, not at the default; six sharing 3,000 save
    15,000, planned at both."""
    from hsx.defaults import DEFAULT_PREFIX_FORWARD_TOKENS

    short = [[7] * 90 + [i] * 100 for i in range(6)]
    long = [[7] * 3000 + [i] * 100 for i in range(6)]
    assert [rows for rows, _ in find_groups(short, 32, 64)] == [list(range(6))]
    assert find_groups(short, 32) == [] and DEFAULT_PREFIX_FORWARD_TOKENS == 512
    assert find_groups(long, 32) == [(list(range(6)), 3000)]


def test_a_nested_group_is_kept_only_where_it_saves_more_than_its_forwards():
    """Six rows share a 3,000-token prompt; two of them share 40 tokens more. The nested group saves 40 tokens
    for 2 forwards (its spine, its rows): kept at a price of 8 tokens a forward, its rows leaves of the prompt's
    group at the default price."""
    base = [7] * 3000
    seqs = [base + [i] * 100 for i in range(1, 5)] + [base + [9] * 40 + [10 + i] * 100 for i in range(2)]
    assert sorted(find_groups(seqs, 32, 8)) == [([0, 1, 2, 3, 4, 5], 3000), ([4, 5], 3040)]
    assert find_groups(seqs, 32) == [([0, 1, 2, 3, 4, 5], 3000)]


def test_the_price_of_a_forward_is_recorded_and_a_run_planned_before_keeps_its_own():
    from dataclasses import replace

    from hsx.runspec.manifest import Manifest, ManifestError
    from tests.manifests import example_manifest

    before = {**json.loads(example_manifest().to_json()), "prefix_reuse": "on", "prefix_min_tokens": 32,
              "prefix_cache_tokens": 8192}
    before.pop("prefix_forward_tokens", None)
    manifest = Manifest.from_json(json.dumps(before))
    assert manifest.prefix_forward_tokens == 0 and manifest.forward_tokens == 256   # planned before: 256
    priced = replace(manifest, prefix_forward_tokens=2560)
    assert json.loads(priced.to_json())["prefix_forward_tokens"] == 2560 and priced.forward_tokens == 2560
    assert Manifest.from_json(priced.to_json()).forward_tokens == 2560
    # the stored tokens a batch of trees may hold: a budget unless recorded (written only when more)
    assert manifest.stored_tokens == manifest.token_budget and "prefix_stored_tokens" not in json.loads(priced.to_json())
    wide = replace(priced, prefix_stored_tokens=4 * manifest.token_budget)
    assert Manifest.from_json(wide.to_json()).stored_tokens == 4 * manifest.token_budget
    # how the rows were planned: padded where not recorded (a run planned before it), written only when packed
    assert manifest.prefix_rows == "padded" and "prefix_rows" not in json.loads(priced.to_json())
    packed = replace(priced, prefix_rows="packed")
    assert Manifest.from_json(packed.to_json()).prefix_rows == "packed" == json.loads(packed.to_json())["prefix_rows"]
    assert packed.rows_packed and not priced.rows_packed
    with pytest.raises(ManifestError, match="prefix_rows"):
        Manifest.from_json(json.dumps({**json.loads(packed.to_json()), "prefix_rows": "sideways"}))


def test_stored_budgets_out_of_bounds_are_refused_by_name():
    from hsx.errors import ConfigError
    from hsx.runspec import stored_tokens

    assert stored_tokens(1, 4096) == 0 and stored_tokens(4, 4096) == 16384
    for budgets, budget in ((0, 4096), (17, 4096), (4, 2**21)):
        with pytest.raises(ConfigError, match=f"--prefix-stored-budgets {budgets}"):
            stored_tokens(budgets, budget)


def test_the_default_stored_budgets_are_four_where_the_bounds_allow():
    """--prefix-stored-budgets 0 (the default): 4 budgets, fewer where a batch would pass MAX_TOKEN_BUDGET or the
    pinned buffers 64 GiB; a value given is kept for check_pinned_memory to judge (refused there by name)."""
    from hsx.defaults import AUTO_PREFIX_STORED_BUDGETS, MAX_TOKEN_BUDGET
    from hsx.errors import ConfigError
    from hsx.runspec.identity import check_pinned_memory, fit_stored_budgets

    per_token = 4 * 5120 * 2   # the 27B's dflash layers in bf16
    assert fit_stored_budgets(AUTO_PREFIX_STORED_BUDGETS, 32768, per_token) == 4
    assert fit_stored_budgets(AUTO_PREFIX_STORED_BUDGETS, MAX_TOKEN_BUDGET // 2, 16) == 2   # tokens a batch
    assert fit_stored_budgets(AUTO_PREFIX_STORED_BUDGETS, 131072, per_token) == 4   # 3 x 512k x 40 KiB = 60 GiB
    assert fit_stored_budgets(AUTO_PREFIX_STORED_BUDGETS, 262144, per_token) == 2   # 4 would pin 120 GiB
    assert fit_stored_budgets(AUTO_PREFIX_STORED_BUDGETS, 2**20, per_token) == 1   # one budget: its own check
    assert fit_stored_budgets(7, 262144, per_token) == 7
    check_pinned_memory(262144, per_token, "bfloat16", 2)
    with pytest.raises(ConfigError, match="--prefix-stored-budgets 7 needs 210 GiB"):
        check_pinned_memory(262144, per_token, "bfloat16", 7)


# ---- whole runs -------------------------------------------------------------------------------------------------

def _check_stored(r, store, run, model_path) -> tuple[int, int, float]:
    """Every stored sample against a lone forward of its stored ids; (stored tokens, computed tokens, max error)."""
    manifest = ledger.get_manifest(r, run)
    ref = AutoModel.from_pretrained(str(model_path), dtype=torch.float32).eval()
    layer_ids = list(manifest.layer_ids)
    worst, stored, computed = 0.0, 0, 0
    for spec in ledger.all_specs(r, run).values():
        key = f"{run}/batches/{spec.shard}/{spec.batch_id}.safetensors"
        got = batchfile.read_batch_bytes(store.get_bytes(key), where=key)
        stored, computed = stored + spec.tokens, computed + spec.computed_tokens
        for b in range(len(got.sample_ids)):
            lo, hi = int(got.cu_seqlens[b]), int(got.cu_seqlens[b + 1])
            with torch.no_grad():
                out = ref(input_ids=got.input_ids[lo:hi].long().unsqueeze(0), output_hidden_states=True)
            want = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            torch.testing.assert_close(got.hidden_states[lo:hi].float(), want, **TOLERANCE)
            worst = max(worst, float((got.hidden_states[lo:hi].float() - want).abs().max()))
    return stored, computed, worst


def _per_turn(tmp_path, rows: int = 40):
    """The first ``rows`` rows of the shipped agentic sample expanded one row per assistant turn."""
    out = tmp_path / "per_turn.jsonl"
    expand_per_turn([sample_dataset().with_name("sample_agentic.jsonl")], out)
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:rows]))
    return out


def test_a_per_turn_run_stores_every_sample_exact_with_spines_across_windows(r, redis_server, tiny_model, tmp_path):
    """Windows of 16 rows: turns of one conversation fall in two windows, each computing the spine once."""
    dataset = _per_turn(tmp_path)
    report = run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="pt",
                          dataset=dataset, max_length=4096, token_budget=8192, window_rows=16,
                          prefix_forward_tokens=TINY_FORWARD_TOKENS)
    manifest = ledger.get_manifest(r, "pt")
    assert manifest.prefix_reuse == "on" and json.loads(manifest.to_json())["prefix_min_tokens"] == 32
    assert any("spines of >= 32 tokens, where a tree saves more than 64 tokens a forward" in line
               for line in report.lines()), report.lines()
    specs = ledger.all_specs(r, "pt").values()
    assert manifest.prefix_rows == "packed" and json.loads(manifest.to_json())["prefix_rows"] == "packed"
    grouped = [{b for first, count, _ in s.prefix_groups for b in range(first, first + count)} for s in specs]
    # a packed plan: rows sharing nothing ride in the tree batches' room
    assert any(s.prefix_groups and len(g) < s.samples for g, s in zip(grouped, specs, strict=True))
    stored, computed, worst = _check_stored(r, open_store(str(tmp_path / "store")), "pt", tiny_model)
    assert stored == report.tokens and computed == report.computed_tokens < 0.75 * stored
    totals = ledger.run_totals(r, "pt")
    assert totals["computed_tokens"] == computed
    # hsx status, the dashboard's /api/status and /metrics: tokens stored against tokens computed
    from dashboard.app import create_app
    from dashboard.config import DashboardConfig
    from hsx.monitor import progress
    from tests.test_dashboard_api import metrics, status

    line = [x for x in progress.summary_lines(progress.run_progress(r, "pt")) if "computed" in x]
    assert line == [f"  computed {computed} tokens planned for {stored} stored (shared prefixes once, padding in; "
                    f"{stored / computed:.2f} stored a computed token)"]
    # the worker's own check: its first batch with prefix groups computed alone too, kept in Redis, shown
    check = life.Run(r, "pt").prefix_error()
    assert check is not None and len(check["rel_l2"]) == len(manifest.layer_ids) and max(check["rel_l2"]) < 1e-5, check
    assert check["groups"] >= 1 and min(check["cosine"]) > 0.99999
    assert [x for x in progress.summary_lines(progress.run_progress(r, "pt")) if "shared vs lone" in x] == \
        [life.Run.prefix_error_line(check)] and "ABOVE" not in life.Run.prefix_error_line(check)
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    assert status(client, "pt")["prefix"] == {"reuse": "on", "stored_tokens": stored, "computed_tokens": computed,
                                              "check": check}
    assert metrics(client)[("hsx_planned_computed_tokens", (("run", "pt"),))] == computed
    print(f"per-turn agentic rows: {stored} tokens stored, {computed} computed; max |reused - lone| {worst:.1e}")


def test_the_workers_check_warns_when_shared_samples_differ_from_lone_ones(r, redis_server, tiny_model, tmp_path,
                                                                           monkeypatch, caplog):
    """A continuation that went wrong on a GPU (here: a perturbed result) is measured on the first batch with
    prefix groups, recorded above the bound, and warned of in the worker's log."""
    real = Extractor.run_shared

    def drifted(self, *args, **kwargs):
        hidden, final = real(self, *args, **kwargs)
        return hidden * 1.05, final

    monkeypatch.setattr(Extractor, "run_shared", drifted)
    with caplog.at_level("WARNING", logger="gpu_worker.runtime"):
        run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="drift",
                     dataset=_per_turn(tmp_path, rows=12), max_length=4096, token_budget=8192,
                     prefix_forward_tokens=TINY_FORWARD_TOKENS)
    check = life.Run(r, "drift").prefix_error()
    assert check is not None and 0.04 < max(check["rel_l2"]) < 0.06, check
    assert "ABOVE 2 %" in life.Run.prefix_error_line(check)
    assert any("differ from the same samples alone by rel L2" in m for m in caplog.messages), caplog.messages


def test_prefix_reuse_off_computes_every_sample_alone(r, redis_server, tiny_model, tmp_path):
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="off",
                 dataset=_per_turn(tmp_path), max_length=4096, token_budget=4096, prefix_reuse="off")
    manifest = ledger.get_manifest(r, "off")
    assert manifest.prefix_reuse == "off" and "prefix_reuse" not in json.loads(manifest.to_json())
    assert not any(s.prefix_groups for s in ledger.all_specs(r, "off").values())


def test_a_resumed_run_plans_the_same_groups_and_stays_exact(r, redis_server, tiny_model, tmp_path):
    """The producer is killed after its second window is queued; the worker extracts what is queued; the
    producer resumes, and the rest is extracted: the plan is the uninterrupted one and every sample exact."""
    from gpu_worker.worker import run_worker
    from producer.produce import produce
    from uploader.worker import run_uploader

    class Killed(Exception):
        pass

    def die(name, window):
        if (name, window) == ("enqueued", 1):
            raise Killed()

    dataset, store = _per_turn(tmp_path), str(tmp_path / "store")
    settings = dict(dataset=dataset, max_length=4096, token_budget=8192, window_rows=16,
                    prefix_forward_tokens=TINY_FORWARD_TOKENS)
    ref = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "ref"), run="ref", enqueue=False,
                                 **settings))
    cfg = produce_config(redis_server.url, tiny_model, store, run="res", **settings)
    with pytest.raises(Killed):
        produce(cfg, on_event=die)
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="res"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    report = produce(cfg)
    assert report.resumed_windows == 1 and report.computed_tokens == ref.computed_tokens < ref.tokens
    assert ({bid: (s.sample_ids, s.prefix_groups) for bid, s in planned_specs(r, "res").items()}
            == {bid: (s.sample_ids, s.prefix_groups) for bid, s in planned_specs(r, "ref").items()})
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="res"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    stored, computed, _ = _check_stored(r, open_store(store), "res", tiny_model)
    assert (stored, computed) == (ref.tokens, ref.computed_tokens)


def test_a_resumed_run_keeps_the_price_it_was_planned_at_and_says_so(r, redis_server, tiny_model, tmp_path, caplog):
    from producer.produce import produce

    settings = dict(dataset=_per_turn(tmp_path, rows=12), max_length=4096, token_budget=8192, enqueue=False)
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="price",
                           prefix_forward_tokens=TINY_FORWARD_TOKENS, **settings))
    with caplog.at_level("WARNING", logger="hsx.runspec.plan"):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="price",
                               prefix_forward_tokens=4096, **settings))
    assert ledger.get_manifest(r, "price").forward_tokens == TINY_FORWARD_TOKENS
    stored = "32768 tokens stored a batch of trees"   # the default stored budgets: 4 x 8192
    assert any(f"keeps shared prefixes on, spines of >= 32 tokens, {TINY_FORWARD_TOKENS} tokens a forward, {stored}, "
               f"rows packed as planned (this call asked on, spines of >= 32 tokens, 4096 tokens a forward, {stored}, "
               "rows packed)" in m
               for m in caplog.messages), \
        caplog.messages


@pytest.mark.parametrize("budgets, rows", [(1, "padded"), (3, "packed"), (0, "packed")])   # 0: auto (4 where they fit)
def test_inspect_predicts_the_plans_stored_and_computed_tokens(budgets, rows, r, redis_server, tiny_model, tmp_path, capsys):
    from hsx_cli.main import main
    from producer.produce import produce

    dataset = _per_turn(tmp_path)
    report = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="ins", dataset=dataset,
                                    max_length=4096, token_budget=4096, window_rows=16, enqueue=False,
                                    prefix_forward_tokens=TINY_FORWARD_TOKENS, prefix_stored_budgets=budgets,
                                    prefix_rows=rows))
    capsys.readouterr()
    assert main(["inspect", "--dataset", str(dataset), "--model", str(tiny_model), "--layers", "dflash:3",
                 "--samples", "0", "--tokenise-workers", "1", "--max-length", "4096", "--token-budget", "4096",
                 "--window-rows", "16", "--max-batch-rows", "64", "--pad-multiple", "1", "--prefix-rows", rows,
                 "--prefix-forward-tokens", str(TINY_FORWARD_TOKENS), "--prefix-stored-budgets", str(budgets)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "shared prefixes (--prefix-reuse auto" in x)
    assert f"{report.tokens:,} tokens stored, {report.computed_tokens:,} computed in {report.batches:,} batches" in line
    resolved = budgets or 4
    assert ledger.get_manifest(r, "ins").stored_tokens == resolved * 4096
    said = "" if resolved == 1 else f", {resolved * 4096:,} stored a batch"
    assert f"spines of >= 32 tokens, {TINY_FORWARD_TOKENS} tokens a forward, rows {rows}{said})" in line
    assert ledger.get_manifest(r, "ins").prefix_rows == rows
    assert report.computed_tokens < report.tokens
    specs = ledger.all_specs(r, "ins").values()
    assert any(s.tokens > 4096 for s in specs) == (resolved > 1)


def test_the_worker_says_the_snapshot_bound_at_start():
    from types import SimpleNamespace

    ex = Extractor(_tiny_hybrid(), LAYERS, store_final=True, out_dtype="float32")
    on = SimpleNamespace(prefix_reuse="on", prefix_min_tokens=32, prefix_cache_tokens=8192, max_batch_rows=64,
                         prefix_stored_tokens=0, rows_packed=False)
    # keys and values: 1 attention layer x 2 x 2 heads x 16 x 4 bytes x 8192 tokens x 2 (expanded to the rows
    # going on, and the held groups' own) = 4,194,304; GDN: 3 layers x (recurrent 4 x 16 x 16 x 4 bytes + conv 128
    # channels x 3 taps x 4 bytes) x (64 rows + 16 held groups) = 1,351,680
    assert prefixrun.snapshot_bytes(ex.model.config, 8192, 64, 4) == 4_194_304 + 1_351_680
    assert ex.prefix_line(on) == "on, spines of >= 32 tokens computed once; snapshots at most 5.3 MiB a batch (8192 cached tokens)"
    off = SimpleNamespace(prefix_reuse="off", forward_tokens=1)
    assert ex.prefix_line(off).startswith("off (--prefix-reuse off") and ex.prefix_plan_warning(off) == ""
    # batches of trees storing 4 budgets: 32,768 tokens x (3 stored layers + the final) x 64 wide x 4 bytes
    wide = SimpleNamespace(**{**vars(on), "prefix_stored_tokens": 32768})
    # a plan priced for the waves, on a worker that runs tree batches group by group (this one): said
    assert not ex.continues and ex.prefix_plan_warning(SimpleNamespace(**vars(on), forward_tokens=2560)) == ""
    assert "planned at 1 token a forward, for" in ex.prefix_plan_warning(SimpleNamespace(**vars(on), forward_tokens=1))
    packed = SimpleNamespace(**{**vars(on), "rows_packed": True})   # rows planned unpadded: said at any price
    assert "planned at 2560 tokens a forward, rows packed, for" in ex.prefix_plan_warning(
        SimpleNamespace(**vars(packed), forward_tokens=2560))
    assert ex.prefix_plan_warning(SimpleNamespace(**vars(packed), forward_tokens=512)).endswith(   # the default's
        "where such a plan can be slower than none (modelled: docs/data.md); plan runs for such workers with hsx "
        "produce --prefix-rows padded --prefix-forward-tokens 2560")
    ex.groupwise_price = 2560   # hsx worker's default: it says that it chooses
    assert "; it runs a batch's samples alone where its trees cost more at 2560 tokens a forward (hsx worker " \
           "--prefix-forward-tokens), which does not undo the plan; plan runs" in \
        ex.prefix_plan_warning(SimpleNamespace(**vars(on), forward_tokens=512))
    ex.continues = True   # a packing worker runs that plan in waves: nothing to say
    assert ex.prefix_plan_warning(SimpleNamespace(**vars(on), forward_tokens=1)) == ""
    assert ex.stored_bytes(32768) == 32768 * 4 * 64 * 4 and ex.prefix_line(wide).endswith(
        "; a batch of trees stores up to 32768 tokens (0.03 GiB of hidden states on the device, as many pinned on "
        "the host)")
    # stored states over half the device memory free after the model: said, naming the flag; not at half or less,
    # nor for a plan of one stored budget or without reuse
    need = ex.stored_bytes(32768)
    assert ex.wide_batch_warning(wide, 2 * need) == "" and ex.wide_batch_warning(on, 1) == ""
    assert ex.wide_batch_warning(SimpleNamespace(**{**vars(wide), "prefix_reuse": "off"}), 1) == ""
    assert "stores up to 32768 tokens, 0.03 GiB of hidden states on the device, where 0.06 GiB are free after the " \
           "model: such a batch may run out of memory (plan the run with a lower --prefix-stored-budgets" \
        in ex.wide_batch_warning(wide, 2 * need - 1)


def test_hsx_worker_takes_its_own_price_of_a_forward(monkeypatch):
    """hsx worker --prefix-forward-tokens: the price a group-by-group worker chooses trees or samples alone at
    (default 2560; 0: trees as planned), from its own variable, not produce's HSX_PREFIX_FORWARD_TOKENS."""
    from hsx_cli import worker as worker_cmd
    from hsx_cli.flags import resolve
    from hsx_cli.main import build_parser

    def cfg(*args):
        return worker_cmd.config(resolve(worker_cmd.FLAGS, build_parser().parse_args(["worker", "--device", "cpu", *args])))

    monkeypatch.setenv("HSX_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("HSX_PREFIX_FORWARD_TOKENS", "1")   # hsx produce's: a plan's price, not this worker's
    assert cfg().prefix_forward_tokens == 2560 and cfg("--prefix-forward-tokens", "0").prefix_forward_tokens == 0
    monkeypatch.setenv("HSX_WORKER_PREFIX_FORWARD_TOKENS", "4096")
    assert cfg().prefix_forward_tokens == 4096
