"""Packed rows through a whole run: produce -> worker -> uploader with the worker packing each plain batch's
samples into one row (the reference kernels stand in for fla's and torch's flash attention: the same glue).
Every stored sample must equal a lone Hugging Face forward of it (tests/test_reference.py's tolerance)."""

from __future__ import annotations

import pytest

from gpu_worker import kernels
from gpu_worker.extractor import Extractor
from hsx import life
from hsx.life import ledger
from hsx.store import open_store
from tests.pipeline import run_pipeline
from tests.test_prefix_reuse import _check_stored


def test_a_packing_worker_stores_every_sample_as_computed_alone(r, redis_server, tiny_model, tmp_path, monkeypatch,
                                                                caplog):
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (kernels.reference_kernels(None), ""))  # dense: no GDN
    forwards = []
    real_run = Extractor.run

    def run(self, batch, convert=True):
        forwards.append((batch.n_tokens, type(batch).__name__))
        return real_run(self, batch, convert)

    monkeypatch.setattr(Extractor, "run", run)
    from gpu_worker.runtime import WorkerRuntime

    totals = []
    real_after = WorkerRuntime.after_batch
    monkeypatch.setattr(WorkerRuntime, "after_batch", lambda self: totals.append(self.totals()) or real_after(self))
    with caplog.at_level("INFO", logger="gpu_worker.runtime"):
        report = run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="pk",
                              prefix_reuse="off")
    said = "rows packed where a batch pads > 3% (varlen attention: sdpa_varlen_attention"
    assert any(said in m for m in caplog.messages), caplog.messages
    specs = ledger.all_specs(r, "pk")
    # a batch padded by more than 3 % of its tokens ran packed, the others padded (defaults.PACK_MIN_PADDING)
    packs = {s.batch_id: s.padded > 1.03 * s.tokens for s in specs.values()}
    want = [(s.tokens, "PackedBatch" if packs[s.batch_id] else "PaddedBatch") for s in specs.values()]
    assert sorted(forwards) == sorted(want) and {kind for _, kind in want} == {"PackedBatch", "PaddedBatch"}
    stored, _, worst = _check_stored(r, open_store(str(tmp_path / "store")), "pk", tiny_model)
    assert stored == report.tokens and worst < 1e-5
    # the worker counts what it computed: real tokens only (the plan counted the padding)
    computed = sum(s.tokens if packs[s.batch_id] else s.padded for s in specs.values())
    assert totals[-1]["tokens"] == report.tokens < totals[-1]["computed"] == computed < sum(s.padded for s in specs.values())


@pytest.mark.parametrize("packing", [True, False])
def test_tree_batches_storing_three_budgets_compute_a_budget_a_forward_and_stay_exact(
        packing, r, redis_server, tiny_model, tmp_path, monkeypatch):
    """--prefix-stored-budgets 3: a batch of shared-prefix trees stores up to three token budgets and computes
    within one. Every forward stays within the budget (waves on a packing worker, the padded runner otherwise),
    every sample equals its lone forward, and the worker's own check of its first tree batch (its samples
    computed alone, a budget a forward where the batch is larger) reads ~0."""
    from tests.test_prefix_reuse import TINY_FORWARD_TOKENS, _per_turn

    if packing:
        monkeypatch.setattr(kernels, "choose", lambda mode, device: (kernels.reference_kernels(None), ""))
    fed = []   # the tokens of every forward the worker ran (a packed row, or padded rows x width)
    real_packed, real_rows = Extractor.forward_rows, Extractor.forward_packed

    def forward_rows(self, batch, *args, **kwargs):
        fed.append(batch.n_tokens)
        return real_packed(self, batch, *args, **kwargs)

    def forward_packed(self, ids, *args, **kwargs):
        fed.append(ids.numel())
        return real_rows(self, ids, *args, **kwargs)

    monkeypatch.setattr(Extractor, "forward_rows", forward_rows)
    monkeypatch.setattr(Extractor, "forward_packed", forward_packed)
    budget = 2048
    report = run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="sb",
                          dataset=_per_turn(tmp_path, rows=60), max_length=budget, token_budget=budget,
                          overlong="truncate", prefix_forward_tokens=TINY_FORWARD_TOKENS, prefix_stored_budgets=3)
    manifest = ledger.get_manifest(r, "sb")
    assert manifest.prefix_stored_tokens == manifest.stored_tokens == 3 * budget
    specs = ledger.all_specs(r, "sb").values()
    trees = [s for s in specs if s.prefix_groups]
    assert any(s.tokens > budget for s in trees) and all(s.tokens <= 3 * budget and s.computed <= budget for s in trees)
    assert all(s.tokens <= budget for s in specs if not s.prefix_groups)
    # the worker's first tree batch, checked against its samples alone (the check's own forwards included)
    check = life.Run(r, "sb").prefix_error()
    assert check is not None and max(check["rel_l2"]) < 1e-5 and check["tokens"] > budget, check   # run in pieces
    assert fed and max(fed) <= budget, sorted(fed)[-5:]
    stored, computed, worst = _check_stored(r, open_store(str(tmp_path / "store")), "sb", tiny_model)
    assert stored == report.tokens and worst < 1e-5
    print(f"packing {packing}: {len(trees)} tree batches of {sorted(s.tokens for s in trees)} tokens; "
          f"{len(fed)} forwards, the largest {max(fed)}; checked batch of {check['tokens']} tokens")
