"""Packed rows through a whole run: produce -> worker -> uploader with the worker packing each plain batch's
samples into one row (the reference kernels stand in for fla's and torch's flash attention: the same glue).
Every stored sample must equal a lone Hugging Face forward of it (tests/test_reference.py's tolerance)."""

from __future__ import annotations

from gpu_worker import kernels
from gpu_worker.extractor import Extractor
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
