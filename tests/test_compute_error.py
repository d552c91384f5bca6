"""FP8 compute's error, measured by the workers on the run's own data (issue 22 item 2).

A float8 run's first batch goes through the reference linears and then the FP8 GEMMs; per stored layer
(and the final state) the relative L2 and cosine are recorded once per run (SET NX), written to
``<run>/compute_error.json`` at completion, and shown by `hsx status`, /api/status and the dashboard next to
the FP8 storage error.

The one part that cannot run here is the check for FP8 tensor cores (no GPU on this machine): the
``no_fp8_gate`` fixture lets a CPU worker past it. The FP8 GEMMs themselves are real: torch's CPU
``_scaled_mm`` computes the same rowwise-scaled e4m3 products the GPU does (tests/test_fp8compute.py).
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from transformers import AutoModel
from werkzeug.serving import make_server

import gpu_worker.worker
from dashboard.app import create_app
from dashboard.config import DashboardConfig
from gpu_worker import fp8compute
from gpu_worker.extractor import Extractor, _decoder, pad_batch
from gpu_worker.fp8linear import Fp8Linear
from gpu_worker.worker import load_runtime
from hsx.batch import batchfile
from hsx.life import computeerror, ledger
from hsx.life.keys import RunKeys
from hsx.life.ledger import BatchSpec
from hsx.life.storeerror import record_store_error
from hsx.monitor.progress import fidelity_lines, run_progress, summary_lines
from hsx.store import layout
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from hsx_tools.tinymodel import build_tiny_model
from producer.produce import produce
from tests.manifests import example_manifest
from tests.pipeline import produce_config, run_pipeline, worker_config
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS
from tests.waiting import scaled

LAYERS = [1, 3]


@pytest.fixture
def no_fp8_gate(monkeypatch):
    """Let a CPU worker past the FP8-tensor-core check (the GEMMs run on torch's CPU ``_scaled_mm``)."""
    monkeypatch.setattr(fp8compute, "require_fp8_device", lambda device: None)
    monkeypatch.setattr(gpu_worker.worker, "require_fp8_device", lambda device: None)


def by_hand(reference: torch.Tensor, x: torch.Tensor, H: int) -> list[tuple[float, float]]:
    """Relative L2 and mean cosine per H-wide column block, written out here (not hsx's own function)."""
    out = []
    for start in range(0, reference.shape[1], H):
        a, b = reference[:, start:start + H].double(), x[:, start:start + H].double()
        rel = float(((b - a) ** 2).sum().sqrt() / (a ** 2).sum().sqrt())
        cos = float(((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))).mean())
        out.append((rel, cos))
    return out


def stored_batch(store, run: str, bid: str, r) -> tuple[ledger.BatchSpec, batchfile.BatchContents]:
    spec = ledger.BatchSpec.from_json(r.hget(RunKeys(run).plan, bid), bid)
    data = (store / layout.batch_key(run, spec.shard, bid)).read_bytes()
    return spec, batchfile.decode_batch(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def test_float8_run_records_its_compute_error_from_its_own_first_batch(r, redis_server, redis_env, tiny_model,
                                                                      tmp_path, capsys, no_fp8_gate):
    store, run = tmp_path / "store", "cerr"
    run_pipeline(redis_server.url, tiny_model, str(store), tmp_path / "spool", run=run, layers="1,3+final",
                 dtype="bfloat16", store_dtype="float8_e4m3", compute_dtype="float8")
    assert r.get(RunKeys(run).index_written)  # complete
    record = json.loads(r.get(RunKeys(run).compute_error))
    assert record["layer_ids"] == [*LAYERS, "final"]
    assert "weights in float32 linears" in record["reference"]  # a CPU worker's bf16 compute is float32
    assert record["accumulation"] == "fp32"   # the default: FP8 GEMMs' partial sums promoted to fp32

    # The figures are those of the run's own batch: recompute them from the tokens stored in it.
    spec, contents = stored_batch(store, run, record["batch_id"], r)
    assert record["tokens"] == spec.tokens == contents.input_ids.numel()
    pad_id = ledger.get_manifest(r, run).pad_token_id
    batch = pad_batch(contents.input_ids, contents.cu_seqlens, spec.padded_len, pad_id, pin=False)
    reference = Extractor.load(str(tiny_model), LAYERS, True, "cpu", "bfloat16")
    fp8 = Extractor.load(str(tiny_model), LAYERS, True, "cpu", "bfloat16", compute_dtype="float8")
    assert any(isinstance(m, Fp8Linear) for m in fp8.decoder.layers.modules())
    (ref_h, ref_f), (h, f) = reference.run(batch), fp8.run(batch)
    H = ref_h.shape[1] // len(LAYERS)
    want = by_hand(ref_h, h, H) + by_hand(ref_f, f, H)
    for column, (rel, cos) in enumerate(want):
        assert record["rel_l2"][column] == pytest.approx(rel, rel=1e-4, abs=1e-6), column
        assert record["cosine"][column] == pytest.approx(cos, abs=1e-5), column
        assert 0.005 < rel < 0.3 and cos > 0.95  # FP8's size of error, not zero, not garbage
    # ...and what the run stored is the FP8 forward: its (FP8-stored) values sit nearer it than the reference.
    assert (contents.hidden_states.float() - h.float()).norm() < (contents.hidden_states.float() - ref_h.float()).norm()

    # Written into the run beside store_error.json once it completed, the same record.
    assert json.loads((store / run / "compute_error.json").read_text()) == record
    store_error = json.loads((store / run / "store_error.json").read_text())

    # `hsx status`: per layer, FP8 compute next to FP8 storage.
    capsys.readouterr()
    assert main(["status", "--run", run]) == 0
    out = capsys.readouterr().out
    assert "computed in float8" in out and "fidelity against bf16" in out
    for column, layer in enumerate(record["layer_ids"]):
        row = next(line for line in out.splitlines() if line.strip().startswith(f"{layer} "))
        assert f"{record['rel_l2'][column]:.4f} / {record['cosine'][column]:.5f}" in row
        assert f"{store_error['rel_l2_mean'][column]:.4f} / {store_error['cosine_mean'][column]:.5f}" in row
    assert f"compute: batch {record['batch_id']}" in out and "fp32 accumulation" in out
    assert main(["status", "--run", run, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fidelity"]["compute"] == record
    assert report["fidelity"]["store"]["rel_l2_mean"] == pytest.approx(store_error["rel_l2_mean"])

    # /api/status and the dashboard page.
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    overview = client.get(f"/api/status?run={run}").get_json()["overview"]
    assert overview["fidelity"]["compute"] == record and overview["compute_dtype"] == "float8"
    page = client.get(f"/?run={run}").get_data(as_text=True)
    assert 'id="fidelity-layers"' in page


def test_one_measurement_a_run_however_many_workers_start(r, redis_server, tiny_model, tmp_path, caplog, no_fp8_gate):
    """Two workers start before either has measured: one wins the claim and pays one extra forward; the
    other converts and runs its batch once; the record is written once (SET NX) and never replaced."""
    run = "cerr2"
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=run, layers="1,3",
                           dtype="bfloat16", compute_dtype="float8", fp8_accumulation="fast"))
    planned = sorted(ledger.all_specs(r, run))
    assert len(planned) >= 4
    bids = planned[:2]
    runtimes = [load_runtime(worker_config(redis_server.url, tmp_path / f"spool{i}", run=run, host=f"h{i}",
                                           worker_name=f"w{i}")) for i in range(2)]
    assert all(rt.measure_compute and rt.extractor.fp8_pending for rt in runtimes)  # no record yet: both may measure
    forwards = [0, 0]
    for i, rt in enumerate(runtimes):
        rt.extractor.decoder.register_forward_hook(lambda *a, i=i: forwards.__setitem__(i, forwards[i] + 1))
        rt.start()
    try:
        with caplog.at_level("INFO", logger="gpu_worker.writer"):
            for rt, bid in zip(runtimes, bids, strict=True):
                rt.extract(bid)
                rt.extract(planned[-1 - runtimes.index(rt)])
            for rt in runtimes:
                assert rt.writer.drain(60)
    finally:
        for rt in runtimes:
            rt.close()
    assert forwards == [3, 2]  # two batches each; the first worker's first batch twice (reference, FP8)
    assert not any(rt.extractor.fp8_pending for rt in runtimes)
    # Both workers' GEMMs accumulate as the run says (--fp8-accumulation fast), the measured one included.
    for rt in runtimes:
        fp8 = [m for m in rt.extractor.decoder.layers.modules() if isinstance(m, Fp8Linear)]
        assert fp8 and all(m.fast_accum for m in fp8) and "fast accumulation" in repr(fp8[0])
    assert sum("float8 compute error measured on" in m for m in caplog.messages) == 1
    record = json.loads(r.get(RunKeys(run).compute_error))
    assert (record["batch_id"], record["worker"]) == (bids[0], "w0") and record["accumulation"] == "fast"
    # A later writer (a worker after a crash of the claimant, a duplicate delivery) never replaces it.
    computeerror.record_compute_error(r, run, bids[1], ledger.get_manifest(r, run), [[0.5, 0.5], [0.1, 0.1]], 7, "other", "w9")
    assert json.loads(r.get(RunKeys(run).compute_error)) == record
    # A worker that starts once the run has its record loads FP8 at once and never measures.
    late = load_runtime(worker_config(redis_server.url, tmp_path / "spool2", run=run, host="h2", worker_name="w2"))
    assert not late.measure_compute and not late.extractor.fp8_pending
    assert any(isinstance(m, Fp8Linear) for m in late.extractor.decoder.layers.modules())
    assert computeerror.claim_compute_error(r, run, "w3", 60) is False


def test_a_worker_decides_once_whether_it_measures(r, redis_server, tiny_model, tmp_path, no_fp8_gate, monkeypatch):
    """Before the model loads, one look at the run's record: the load (linears kept) and the runtime take that."""
    from hsx import life

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="cerr3", layers="1,3",
                           dtype="bfloat16", compute_dtype="float8"))
    looks = []
    recorded = life.Run.compute_error_recorded
    monkeypatch.setattr(life.Run, "compute_error_recorded", lambda run: looks.append(run.name) or recorded(run))
    rt = load_runtime(worker_config(redis_server.url, tmp_path / "spool", run="cerr3"))
    try:
        assert looks == ["cerr3"] and rt.measure_compute and rt.extractor.fp8_pending
    finally:
        rt.prefetcher.close()


def test_fp8_checkpoint_is_measured_against_its_dequantised_weights(tmp_path, no_fp8_gate):
    """An FP8 checkpoint has no bf16 weights: the reference is bf16 linears of its e4m3 weights dequantised,
    recomputed here with an ordinary bf16 model whose linear weights are set to those values."""
    bf16 = build_tiny_model(tmp_path / "bf16", num_layers=3, hidden_size=128, seed=3, sample_path=sample_dataset())
    fp8compute.write_fp8_checkpoint(bf16, tmp_path / "fp8")
    ex = Extractor.load(str(tmp_path / "fp8"), [0, 2], False, "cpu", "bfloat16", compute_dtype="float8",
                        measure_compute=True)
    ids = torch.randint(3, 400, (70,), generator=torch.Generator().manual_seed(0))
    batch = pad_batch(ids, torch.tensor([0, 30, 70]), 48, 0, pin=False)
    hidden, final, error, reference = ex.run_measured(batch)
    assert final is None and error.shape == (2, 2) and "dequantised" in reference

    ref_model = AutoModel.from_pretrained(str(bf16), dtype=torch.bfloat16)
    fp8_layers = dict(_decoder(ex.model).layers.named_modules())
    with torch.no_grad():
        for name, module in _decoder(ref_model).layers.named_modules():
            if isinstance(fp8_layers.get(name), Fp8Linear):
                module.weight.copy_(fp8_layers[name].dequantised().to(torch.bfloat16))
    ref = Extractor(ref_model, [0, 2], False, "bfloat16").run(batch)[0]
    assert torch.equal(hidden, ex.run(batch)[0])  # the FP8 pass is the one stored
    for column, (rel, cos) in enumerate(by_hand(ref, hidden, ref.shape[1] // 2)):
        assert float(error[0, column]) == pytest.approx(rel, rel=1e-3, abs=1e-6)
        assert float(error[1, column]) == pytest.approx(cos, abs=1e-5)
        assert 0 < rel < 0.2


def test_status_shows_the_storage_error_alone_where_compute_was_bf16():
    store = {"layer_ids": [1, 3], "rel_l2_mean": [0.026, 0.027], "rel_l2_max": [0.03, 0.031],
             "cosine_mean": [0.9996, 0.9995], "cosine_min": [0.999, 0.998], "batches_measured": 2,
             "tokens_measured": 900}
    lines = fidelity_lines({"layer_ids": [1, 3], "compute": None, "store": store})
    row = next(line for line in lines if line.strip().startswith("3 "))
    assert row.split()[1] == "-" and "0.0270 / 0.99950" in row and "0.0310 / 0.99800" in row
    assert not any(line.strip().startswith("compute:") for line in lines)


def test_dashboard_page_shows_compute_next_to_storage_per_layer(r, redis_server):
    """Headless Chromium on the run page: one row a stored layer with both errors; hidden for a bf16 run;
    the reference text (from Redis) shown as text."""
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import expect, sync_playwright

    specs = [BatchSpec(batch_id=f"b{i:04d}", index=i, shard="00000", samples=2, tokens=100, padded=128,
                       padded_len=64, sample_ids=[f"s{i}-{j}" for j in range(2)]) for i in range(2)]
    totals = {"batches": 2, "samples": 4, "tokens": 200}
    fp8 = dict(model="tiny", layer_ids=(1, 3), store_final=True, compute_dtype="float8", store_dtype="float8_e4m3")
    manifest = example_manifest("fp8page", **fp8)
    ledger.save_plan(r, "fp8page", manifest, specs, totals)
    ledger.save_plan(r, "bf16page", example_manifest("bf16page", **{**fp8, "compute_dtype": "bfloat16",
                                                                    "store_dtype": "bfloat16"}), specs, totals)
    computeerror.record_compute_error(r, "fp8page", "b0000", manifest, [[0.0127, 0.0146, 0.0201], [0.99992, 0.99989, 0.9998]],
                        100, "<img src=x> reference", "w0")
    for bid, rel, cos in (("b0000", 0.0263, 0.9997), ("b0001", 0.0265, 0.9996)):
        record_store_error(r, "fp8page", bid, manifest, [[rel] * 3, [cos] * 3], 100)
    app = create_app(DashboardConfig(redis_url=redis_server.url, refresh_seconds=0.5), r)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.goto(f"{base}/?run=fp8page")
            expect(page.locator("#fidelity")).to_be_visible(timeout=scaled(60) * 1000)
            rows = page.locator("#fidelity-layers tbody tr")
            expect(rows).to_have_count(3)
            cells = [rows.nth(i).locator("td").all_inner_texts() for i in range(3)]
            storage = ["0.0264 / 0.99965", "0.0265 / 0.99960"]  # token-weighted mean; worst batch
            assert cells == [["1", "0.0127 / 0.99992", *storage], ["3", "0.0146 / 0.99989", *storage],
                             ["final", "0.0201 / 0.99980", *storage]]
            note = page.locator("#fidelity-note").inner_text()
            assert "batch b0000" in note and "<img src=x> reference" in note and "2 batches" in note
            assert page.locator("#fidelity img").count() == 0
            assert "computed in float8" in page.locator("#storage").inner_text()
            page.goto(f"{base}/?run=bf16page")
            expect(page.locator("#run-state")).not_to_have_text("loading", timeout=scaled(60) * 1000)
            expect(page.locator("#fidelity")).to_be_hidden()
            browser.close()
    finally:
        server.shutdown()


def test_records_hsx_did_not_write_are_named_and_skipped(r):
    spec = BatchSpec(batch_id="b0000", index=0, shard="00000", samples=1, tokens=10, padded=16, padded_len=16,
                     sample_ids=["s0"])
    manifest = example_manifest("bad", model="tiny", layer_ids=(1, 3), compute_dtype="float8")
    ledger.save_plan(r, "bad", manifest, [spec], {"batches": 1, "samples": 1, "tokens": 10})
    keys = RunKeys("bad")
    r.set(keys.compute_error, json.dumps({"layer_ids": [1, 3], "rel_l2": [0.1], "cosine": [1, 1]}))
    r.hset(keys.store_error, mapping={"b0000": "not json", "b0001": json.dumps({"tokens": 5, "layer_ids": [1, 3],
                                                                                "rel_l2": [0.02, 0.03],
                                                                                "cosine": [0.99, 0.98]})})
    p = run_progress(r, "bad")
    assert p["fidelity"]["compute"] is None and p["fidelity"]["store"]["rel_l2_max"] == [0.02, 0.03]
    assert f"{keys.compute_error}: 'rel_l2' is not 2 numbers" in p["malformed"]
    assert f"{keys.store_error} b0000: not a JSON object with integer 'tokens'" in p["malformed"]
    text = "\n".join(summary_lines(p))
    assert "fidelity against bf16" in text and "FP8 compute error not measured yet" in text
