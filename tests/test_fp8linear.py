"""FP8 linears (issue 22): an activation read by several linears (q/k/v, gate/up, a Gated DeltaNet's in_proj_*)
is quantised once, with the same numbers as quantising it for each. Runs on torch's CPU ``_scaled_mm`` (the
reference quantiser); the GPU's Triton quantiser is checked against the reference by bench/fp8_speed.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from gpu_worker import fp8linear
from gpu_worker.extractor import _decoder
from gpu_worker.fp8linear import Fp8Linear


def _linear(n_in: int, n_out: int, seed: int) -> Fp8Linear:
    torch.manual_seed(seed)
    return Fp8Linear.of(torch.nn.Linear(n_in, n_out, bias=False).to(torch.bfloat16))


def test_linears_reading_one_activation_quantise_it_once():
    a, b = _linear(64, 32, 1), _linear(64, 48, 2)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        ya = a(x)
        quantised = fp8linear._last.q
        yb = b(x)
        assert fp8linear._last.q is quantised                 # b reused a's quantised input
        other = x.clone()                                      # same values, another tensor: quantised anew
        yb2 = b(other)
        assert fp8linear._last.q is not quantised
    assert torch.equal(yb, yb2)
    xq, xs = fp8linear.quantise_rows(x.reshape(-1, 64))
    expected = torch._scaled_mm(xq, b.weight.t(), scale_a=xs, scale_b=b.weight_scale.t(), out_dtype=torch.bfloat16)
    assert torch.equal(yb.reshape(-1, 48), expected) and ya.shape == (2, 5, 32)


def _tiny_hybrid():
    import transformers

    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip("this transformers has no Qwen3.5")
    config = transformers.Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            linear_num_key_heads=2, linear_num_value_heads=16,  # b/a 16 wide: FP8
                                            linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    return AutoModel.from_config(config, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3.5 hybrid"])
def test_a_layer_quantises_each_activation_once_with_the_same_numbers(kind, tiny_model, monkeypatch):
    model = (AutoModel.from_pretrained(str(tiny_model), dtype=torch.bfloat16).eval() if kind == "qwen3"
             else _tiny_hybrid())
    layers = _decoder(model).layers
    linears = fp8linear.convert_linears(layers)
    calls = []
    real = fp8linear.quantise_activations
    monkeypatch.setattr(fp8linear, "quantise_activations", lambda x: calls.append(x.shape) or real(x))
    ids = torch.randint(0, 200, (2, 24))
    with torch.inference_mode():
        monkeypatch.setattr(fp8linear, "SHARE_INPUTS", False)
        separate = model(input_ids=ids).last_hidden_state
        assert len(calls) == linears == (7 * len(layers) if kind == "qwen3" else 8 * 3 + 7)  # q k v o / qkv z b a out; 3 MLP
        calls.clear()
        monkeypatch.setattr(fp8linear, "SHARE_INPUTS", True)
        shared = model(input_ids=ids).last_hidden_state
    assert len(calls) == 4 * len(layers)  # attention (or Gated DeltaNet) input, its output, MLP input, down_proj's
    assert torch.equal(shared, separate)


@pytest.mark.parametrize("fast", [False, True])
def test_the_accumulation_asked_for_reaches_the_gemm(monkeypatch, fast):
    """--fp8-accumulation ends as ``use_fast_accum`` of every ``torch._scaled_mm`` call (the CPU ignores it, an
    H200 does not: docs/benchmarks.md), for linears converted from bf16 ones."""
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kw):
        seen.append(kw["use_fast_accum"])
        return real(*args, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    assert fp8linear.convert_linears(layers, fast_accum=fast) == 2
    with torch.inference_mode():
        layers(torch.randn(3, 64, dtype=torch.bfloat16))
    assert seen == [fast, fast]
