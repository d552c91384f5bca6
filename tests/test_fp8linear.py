"""FP8 linears (issue 22): an activation read by several linears is quantised once, and siblings that read one
activation (q/k/v, gate/up, a Gated DeltaNet's in_proj_*) run as one GEMM whose column slices are each
member's output: the same numbers as separate GEMMs. Runs on torch's CPU ``_scaled_mm`` (the reference
quantiser); the GPU's Triton quantiser is checked against the reference by bench/fp8_speed.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from gpu_worker.extractor import _decoder
from hsx import fp8linear
from hsx.fp8linear import Fp8Linear


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
                                            linear_num_key_heads=2, linear_num_value_heads=16,  # in_proj_b/a 16 wide
                                            linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    return AutoModel.from_config(config, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3.5 hybrid"])
def test_fused_siblings_give_the_separate_gemms_numbers_and_keep_no_output(kind, tiny_model):
    model = (AutoModel.from_pretrained(str(tiny_model), dtype=torch.bfloat16).eval() if kind == "qwen3"
             else _tiny_hybrid())
    layers = _decoder(model).layers
    fp8linear.convert_linears(layers, fuse=False)
    ids = torch.randint(0, 200, (2, 24))
    with torch.inference_mode():
        separate = model(input_ids=ids).last_hidden_state
    groups = fp8linear.fuse_siblings(layers)
    members = [m for m in layers.modules() if isinstance(m, Fp8Linear) and m.group is not None]
    if kind == "qwen3":
        assert groups == 2 * len(layers) and len(members) == 5 * len(layers)   # q/k/v and gate/up a layer
    else:  # 3 Gated DeltaNet layers (in_proj_qkv/z/b/a) + 1 attention layer (q/k/v), gate/up in all 4
        assert groups == 2 * len(layers) and len(members) == 3 * 4 + 3 + 2 * len(layers)
    for m in members:  # a member's weight is a view of its group's: no second copy
        group_ptr = m.group.weight.untyped_storage().data_ptr()
        assert m.weight.untyped_storage().data_ptr() == group_ptr
    with torch.inference_mode():
        fused = model(input_ids=ids).last_hidden_state
    assert torch.equal(fused, separate)
    assert all(m.group._out is None for m in members)  # every member took its slice: nothing held between batches
