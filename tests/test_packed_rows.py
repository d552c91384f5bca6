"""Packed rows through a whole run: produce -> worker -> uploader with the worker packing each plain batch's
samples into one row (the reference kernels stand in for fla's and torch's flash attention: the same glue).
Every stored sample must equal a lone Hugging Face forward of it (tests/test_reference.py's tolerance)."""

from __future__ import annotations

from gpu_worker import kernels
from gpu_worker.extractor import Extractor, PackedBatch
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
        forwards.append(type(batch))
        return real_run(self, batch, convert)

    monkeypatch.setattr(Extractor, "run", run)
    from gpu_worker.runtime import WorkerRuntime

    totals = []
    real_after = WorkerRuntime.after_batch
    monkeypatch.setattr(WorkerRuntime, "after_batch", lambda self: totals.append(self.totals()) or real_after(self))
    with caplog.at_level("INFO", logger="gpu_worker.runtime"):
        report = run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="pk",
                              prefix_reuse="off")
    assert any("rows packed (varlen attention: sdpa_varlen_attention" in m for m in caplog.messages), caplog.messages
    specs = ledger.all_specs(r, "pk")
    assert len(forwards) == len(specs) > 1 and set(forwards) == {PackedBatch}
    assert any(s.padded > s.tokens for s in specs.values())   # the plan padded rows the worker did not compute
    stored, _, worst = _check_stored(r, open_store(str(tmp_path / "store")), "pk", tiny_model)
    assert stored == report.tokens and worst < 1e-5
    # the worker counts what it computed: real tokens only (the plan counted the padding)
    assert totals[-1]["tokens"] == totals[-1]["computed"] == report.tokens < sum(s.padded for s in specs.values())
