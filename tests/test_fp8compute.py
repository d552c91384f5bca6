"""`--compute-dtype float8` (issue 22): the manifest field, the refusal where FP8 tensor cores are absent, and
FP8 (e4m3, 128x128 block-scaled) checkpoints loaded as they are stored. The GEMM's speed is the GPU
benchmark's business (bench/run_gpu.sh 8b-compute / 27b-compute); torch's CPU ``_scaled_mm`` runs the
same layers here, slowly, so the loaded model's forward is checked too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from gpu_worker import fp8compute, fp8linear
from gpu_worker.extractor import Extractor, _decoder
from gpu_worker.fp8compute import ComputeDtypeError
from gpu_worker.fp8linear import Fp8Linear
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from hsx_tools.tinymodel import build_tiny_model
from tests.test_cli_errors import one_error_line


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """A tiny Qwen3 (H 256, so 128x128 blocks: 2x2 of them per attention weight) and its FP8 block-scaled copy."""
    root = tmp_path_factory.mktemp("fp8")
    bf16 = build_tiny_model(root / "bf16", num_layers=3, hidden_size=256, seed=1, sample_path=sample_dataset())
    quantised = fp8compute.write_fp8_checkpoint(bf16, root / "fp8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (bf16 / name).exists():
            (root / "fp8" / name).write_bytes((bf16 / name).read_bytes())
    return bf16, root / "fp8", quantised


def test_fp8_checkpoint_is_stored_as_the_published_releases(fp8_pair):
    _, fp8, quantised = fp8_pair
    assert quantised == 3 * 7  # q k v o gate up down, every layer
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(str(next(fp8.glob("*.safetensors"))), framework="pt") as fh:
        key = next(k for k in fh.keys() if k.endswith("layers.0.self_attn.q_proj.weight"))
        assert fh.get_tensor(key).dtype == torch.float8_e4m3fn
        scale = fh.get_tensor(key.removesuffix("weight") + "weight_scale_inv")
        w = fh.get_tensor(key)
        assert scale.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))


def test_fp8_checkpoint_loads_as_fp8_linears_without_a_bf16_copy(fp8_pair):
    bf16, fp8, _ = fp8_pair
    from transformers import AutoModel

    ref = AutoModel.from_pretrained(str(bf16), dtype=torch.bfloat16)
    model = fp8compute.load_fp8_checkpoint(str(fp8), "cpu")
    layers = _decoder(model).layers
    linears = [m for m in layers.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 21 and not any(type(m) is torch.nn.Linear for m in layers.modules())
    assert not any(m.fast_accum for m in linears)   # fp32 accumulation unless the run asks for fast
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in linears)  # held as stored, never widened
    # Block scales -> row scales keeps the weights within e4m3's own error of the bf16 originals.
    w_ref = ref.layers[1].mlp.down_proj.weight.detach().float()
    w = model.layers[1].mlp.down_proj.dequantised().detach()
    assert float((w - w_ref).norm() / w_ref.norm()) < 0.05
    # Everything that is not a quantised linear is the checkpoint's own tensor, bit for bit.
    assert torch.equal(model.embed_tokens.weight, ref.embed_tokens.weight)
    assert torch.equal(model.layers[2].input_layernorm.weight, ref.layers[2].input_layernorm.weight)
    assert torch.allclose(model.rotary_emb.inv_freq, ref.rotary_emb.inv_freq)
    ids = torch.randint(0, 400, (2, 32))
    with torch.inference_mode():
        a, b = ref(input_ids=ids).last_hidden_state.float(), model(input_ids=ids).last_hidden_state.float()
    assert float((a - b).norm() / a.norm()) < 0.15
    cos = torch.nn.functional.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=1)
    assert float(cos.mean()) > 0.99


def test_block_to_row_rescale_costs_one_e4m3_rounding_and_nothing_where_a_row_shares_one_scale():
    w = torch.randn(256, 384) * torch.linspace(0.1, 10, 384)  # outlier columns: block scales differ along a row
    q, s = fp8compute.quantise_blocks(w)
    deq_blocks = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q_rows, row_scale = fp8compute.rows_from_blocks(q, s)
    assert q_rows.dtype == torch.float8_e4m3fn and row_scale.shape == (256, 1)
    rel = float((q_rows.float() * row_scale - deq_blocks).norm() / deq_blocks.norm())
    assert rel < 0.025  # one more e4m3 rounding (~1.5 %): a float format keeps its relative precision scaled down
    same = fp8compute.rows_from_blocks(q, torch.ones_like(s))[0]
    assert torch.equal(same.view(torch.uint8), q.view(torch.uint8))


def test_an_fp8_checkpoint_loaded_by_the_worker_accumulates_as_the_run_says(fp8_pair, monkeypatch):
    """The worker's loader hands the run's --fp8-accumulation to the FP8-checkpoint loader (past the FP8
    tensor-core check, which a CPU fails)."""
    _, fp8, _ = fp8_pair
    monkeypatch.setattr(fp8compute, "require_fp8_device", lambda device: None)
    for accumulation in ("fast", "fp32"):
        ex = Extractor.load(str(fp8), [0, 2], False, "cpu", "bfloat16", compute_dtype="float8",
                            fp8_accumulation=accumulation)
        linears = [m for m in ex.decoder.layers.modules() if isinstance(m, Fp8Linear)]
        assert linears and all(m.fast_accum == (accumulation == "fast") for m in linears), accumulation


def test_worker_on_cpu_refuses_float8_compute_in_one_line(tiny_model):
    with pytest.raises(ComputeDtypeError, match=r"FP8 tensor cores .*this worker's device is cpu"):
        Extractor.load(str(tiny_model), [1, 3], False, "cpu", "float32", compute_dtype="float8")
    with pytest.raises(ComputeDtypeError, match="compute dtype 'float16'"):
        fp8compute.check_compute_dtype("float16")


def test_compute_dtype_is_in_the_manifest_and_workers_obey_it(tiny_model, tmp_path, capsys, redis_env, r):
    common = ["--dataset", str(sample_dataset()), "--model", str(tiny_model), "--layers", "dflash:3",
              "--store", str(tmp_path / "store"), "--run", "fp8c", "--dtype", "float32"]
    assert main(["produce", *common, "--compute-dtype", "float8"]) == 0
    from hsx.life import ledger

    assert (ledger.get_manifest(r, "fp8c").compute_dtype, ledger.get_manifest(r, "fp8c").fp8_accumulation) \
        == ("float8", "fp32")   # GEMMs accumulate in fp32 unless asked (--fp8-accumulation fast)
    stored = json.loads(next((tmp_path / "store").rglob("manifest.json")).read_text())
    assert (stored["compute_dtype"], stored["fp8_accumulation"]) == ("float8", "fp32")
    # Fast accumulation is a float8 choice: asked of a bf16 run, refused in one line before anything is planned.
    capsys.readouterr()
    assert main(["produce", *common[:-4], "--run", "bf16fast", "--fp8-accumulation", "fast"]) == 2
    assert "--fp8-accumulation fast applies to --compute-dtype float8 only" in capsys.readouterr().err
    assert ledger.get_manifest(r, "bf16fast") is None
    # ...and so is a resume at the other accumulation.
    assert main(["produce", *common, "--compute-dtype", "float8", "--fp8-accumulation", "fast"]) == 2
    assert "fp8_accumulation: run has 'fp32', this call has 'fast'" in capsys.readouterr().err
    # A resume at another compute dtype would mix outputs: refused.
    capsys.readouterr()
    assert main(["produce", *common]) == 2
    err = capsys.readouterr().err
    assert "compute_dtype: run has 'float8', this call has 'bfloat16'" in err
    capsys.readouterr()
    code = main(["worker", "--run", "fp8c", "--device", "cpu", "--burst", "--spool-dir", str(tmp_path / "spool")])
    assert code == 2
    line = one_error_line(capsys, "worker")
    assert "compute dtype float8" in line and "device is cpu" in line


def test_fp8_linear_forward_matches_bf16_within_e4m3_error():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 7, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        y_ref = lin(x).float()
    y = Fp8Linear.of(lin)(x)
    assert y.shape == (3, 7, 128) and y.dtype == torch.bfloat16
    assert float((y.float() - y_ref).norm() / y_ref.norm()) < 0.06
    model_layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))  # 8 wide: kept as it is
    assert fp8linear.convert_linears(model_layers) == 1
    assert isinstance(model_layers[0], Fp8Linear) and type(model_layers[1]) is torch.nn.Linear
