"""Every store dtype x codec through worker -> store -> reader (object and range reads) and both exports.

Lossless formats must read back exactly what the bf16/no-codec run stored; FP8 within the error the
worker measured and recorded (``<run>/store_error.json``). Same model, data and plan for every run.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hsx.batch import batchfile
from hsx_cli.main import main
from hsx_reader import RunDataset
from hsx_tools.export import specforge_path, speculators_path
from tests.pipeline import run_pipeline

FORMATS = [("bfloat16", "none"), ("bfloat16", "zstd"), ("float8_e4m3", "none"), ("float8_e4m3", "zstd")]
_RUNS: dict = {}


@pytest.fixture(scope="module")
def runs(redis_server, tmp_path_factory, tiny8_model):
    """One eagle3 run (final state stored, so both exports apply) per format, same tiny 8-layer model."""
    if not _RUNS:
        root = tmp_path_factory.mktemp("formats")
        model = tiny8_model
        for store_dtype, codec in FORMATS:
            run = f"fmt-{store_dtype.replace('_', '')}-{codec}"
            run_pipeline(redis_server.url, model, str(root / "store"), root / f"spool-{run}", run=run,
                         layers="eagle3", dtype="bfloat16", store_dtype=store_dtype, codec=codec)
            _RUNS[(store_dtype, codec)] = (root / "store", run)
    return _RUNS


def _all_samples(store, run, fetch="object") -> dict[str, dict]:
    ds = RunDataset(str(store), run, fetch=fetch, cache_bytes=0)
    return {s["sample_id"]: s for s in (ds[i] for i in range(len(ds)))}


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("store_dtype,codec", FORMATS[1:])
def test_reader_gets_the_bf16_values_back(runs, store_dtype, codec):
    base_store, base_run = runs[("bfloat16", "none")]
    store, run = runs[(store_dtype, codec)]
    manifest = json.loads((store / run / "manifest.json").read_text())
    assert (manifest["store_dtype"], manifest["codec"]) == (store_dtype, codec)
    want = _all_samples(base_store, base_run)
    for fetch in ("object", "range"):
        got = _all_samples(store, run, fetch)
        assert got.keys() == want.keys()
        for sid, sample in got.items():
            assert torch.equal(sample["input_ids"], want[sid]["input_ids"])
            assert torch.equal(sample["loss_mask"], want[sid]["loss_mask"])
            assert sample["hidden_states"].dtype == torch.bfloat16
            if store_dtype == "bfloat16":  # lossless: bit for bit
                assert torch.equal(sample["hidden_states"], want[sid]["hidden_states"]), sid
                assert torch.equal(sample["final_hidden_states"], want[sid]["final_hidden_states"]), sid
    if store_dtype == "float8_e4m3":
        record = json.loads((store / run / "store_error.json").read_text())
        n = len(manifest["layer_ids"])
        assert len(record["rel_l2_max"]) == n + 1 and record["batches_measured"] >= 1
        H = manifest["hidden_size"]
        got_all = torch.cat([got[sid]["hidden_states"] for sid in sorted(want)])
        want_all = torch.cat([want[sid]["hidden_states"] for sid in sorted(want)])
        for layer in range(n):
            err = _rel_l2(got_all[:, layer * H:(layer + 1) * H], want_all[:, layer * H:(layer + 1) * H])
            # the record samples some batches; the whole run's error is of the same size (FP8: ~2-4 %)
            assert 0 < err <= 1.5 * record["rel_l2_max"][layer] + 2e-3, (layer, err, record)
            assert record["cosine_min"][layer] > 0.99


def test_compressed_files_are_smaller_and_decode_with_the_one_decoder(runs):
    sizes = {}
    for fmt, (store, run) in runs.items():
        files = sorted((store / run / "batches").rglob("*.safetensors"))
        sizes[fmt] = sum(p.stat().st_size for p in files)
        contents = batchfile.read_batch_bytes(files[0].read_bytes(), where=str(files[0]))
        assert contents.hidden_states.dtype == torch.bfloat16
        header = batchfile.parse_header(files[0].read_bytes()[:1 << 16], str(files[0]))
        assert (("hidden_states.zstd" in header.tensors) == (fmt[1] == "zstd"))
        assert (header.stored("hidden_states")[0] == torch.float8_e4m3fn) == (fmt[0] == "float8_e4m3")
    assert sizes[("bfloat16", "zstd")] < sizes[("bfloat16", "none")]
    assert sizes[("float8_e4m3", "none")] < 0.6 * sizes[("bfloat16", "none")]
    assert sizes[("float8_e4m3", "zstd")] < sizes[("float8_e4m3", "none")]


@pytest.mark.parametrize("store_dtype,codec", FORMATS)
def test_both_exports(runs, tmp_path, store_dtype, codec):
    base_store, base_run = runs[("bfloat16", "none")]
    store, run = runs[(store_dtype, codec)]
    for fmt in ("specforge", "speculators"):
        for which, (st, rn) in (("base", (base_store, base_run)), ("got", (store, run))):
            assert main(["export", "--run", rn, "--format", fmt, "--out", str(tmp_path / fmt / which),
                         "--store", str(st), "--limit", "12"]) == 0
        info = json.loads((tmp_path / fmt / "got" / "hsx_export.json").read_text())
        fp8 = store_dtype == "float8_e4m3"
        for position in range(12):
            if fmt == "specforge":
                got = torch.load(specforge_path(tmp_path / fmt / "got", position))
                want = torch.load(specforge_path(tmp_path / fmt / "base", position))
                assert info["dequantised"] == fp8
                pairs = [(got["aux_hidden_state"], want["aux_hidden_state"]), (got["hidden_state"], want["hidden_state"])]
            else:
                got = load_file(str(speculators_path(tmp_path / fmt / "got", position)))
                want = load_file(str(speculators_path(tmp_path / fmt / "base", position)))
                if fp8:  # hs-connectors' fp8 layout: fp8 [T, n+1, H] + float32 scales [T, n+1, 1] (broadcast)
                    assert got["hidden_states"].dtype == torch.float8_e4m3fn
                    assert got["hidden_states_scales"].shape == got["hidden_states"].shape[:2] + (1,)
                    got["hidden_states"] = got["hidden_states"].float() * got["hidden_states_scales"]
                    assert info["dtype"] == "float8_e4m3"
                pairs = [(got["hidden_states"], want["hidden_states"])]
            assert torch.equal(got["input_ids" if fmt == "specforge" else "token_ids"],
                               want["input_ids" if fmt == "specforge" else "token_ids"])
            for g, w in pairs:
                if fp8:
                    assert _rel_l2(g, w) < 0.1
                else:
                    assert torch.equal(g, w)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_speculators_fp8_export_keeps_the_stored_codes(runs, tmp_path, codec):
    """Every sample (160, 27 batches) of an FP8 run exported for speculators, read as hs-connectors' fp8 backend
    reads it (codes times broadcast scales), against the same run read in place (the hsx backend's record):
    the run's layers are the same values (no second rounding); each slot's error against the bf16 run is
    printed per layer (docs/training.md)."""
    from hsx_tools.export import final_norm_gain, speculators_record

    base_store, base_run = runs[("bfloat16", "none")]
    store, run = runs[("float8_e4m3", codec)]
    out = tmp_path / "spec"
    assert main(["export", "--run", run, "--for", "speculators-eagle3", "--out", str(out), "--store", str(store)]) == 0
    in_place, truth = RunDataset(str(store), run), RunDataset(str(base_store), base_run)
    H = in_place.index.hidden_size
    gain = final_norm_gain(in_place.manifest.model, H)
    sums, differ = {"export": None, "in place": None}, []
    for position in range(len(in_place)):
        sample = in_place[position]
        want = speculators_record(truth.get(sample["sample_id"]), H, gain)["hidden_states"].float()
        here = speculators_record(sample, H, gain)["hidden_states"]
        got = load_file(str(speculators_path(out, position)))
        codes, scales = got["hidden_states"], got["hidden_states_scales"]
        n = here.shape[1] - 1
        if not torch.equal((codes.float() * scales)[:, :n].to(here.dtype), here[:, :n]):    # the stored values?
            differ.append(position)
        trained = codes.to(here.dtype) * scales.to(here.dtype)    # as hs_connectors.fp8_utils dequantises
        for name, values in (("export", trained.float()), ("in place", here.float())):
            err = ((values - want) ** 2).sum(dim=(0, 2)), (want ** 2).sum(dim=(0, 2))
            sums[name] = err if sums[name] is None else (sums[name][0] + err[0], sums[name][1] + err[1])
    per_slot = {name: [round(100 * float((e / w).sqrt()), 3) for e, w in zip(*sums[name], strict=True)]
                for name in sums}
    print(f"\nFP8 ({codec}) rel L2 % per speculators slot vs the bf16 run, {len(in_place)} samples: {per_slot}")
    assert not differ, f"{len(differ)} of {len(in_place)} samples' layers differ from the run read in place"
    for exported, read in zip(per_slot["export"], per_slot["in place"], strict=True):
        assert abs(exported - read) < 0.05 * read, per_slot      # the scale's rounding to bf16 only
