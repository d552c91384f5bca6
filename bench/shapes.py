"""Model shapes the GPU benchmark builds with random weights (weights do not change the compute).

Each shape is a transformers config; ``build_model`` makes the body only
(``AutoModel``: no lm_head) directly on the device, so a 32B shape needs no
checkpoint and no host copy.
"""

from __future__ import annotations

import torch

# name: (hidden, intermediate, layers, heads, kv heads, head dim), as in ../shared/bench/forward_ceiling.py
DENSE = {
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128),
    "qwen3-32b": (5120, 25600, 64, 64, 8, 128),
    "tiny": (64, 128, 6, 4, 2, 16),
}
HYBRID = ("hybrid", "hybrid27b", "tiny-hybrid")  # Qwen3.5-style: Gated DeltaNet layers, every 4th layer full attention
# The Qwen3.5/3.6-27B text config: 64 layers, H 5120, 3 linear (Gated DeltaNet) : 1 full attention.
HYBRID_27B = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128)
SHAPES = tuple(DENSE) + HYBRID


def make_config(shape: str, vocab_size: int | None = None):
    """The transformers config of ``shape``; ``vocab_size`` overrides the real vocabulary (tiny shapes)."""
    if shape in DENSE:
        from transformers import Qwen3Config

        h, inter, layers, heads, kv, hd = DENSE[shape]
        cfg = Qwen3Config(vocab_size=vocab_size or 151936, hidden_size=h, intermediate_size=inter,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                          head_dim=hd, max_position_embeddings=32768, tie_word_embeddings=False)
    elif shape in HYBRID:
        cfg = _hybrid_config(tiny=shape == "tiny-hybrid", vocab_size=vocab_size, big=shape == "hybrid27b")
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg._attn_implementation = "sdpa"
    return cfg


def _hybrid_config(tiny: bool, vocab_size: int | None, big: bool = False):
    """transformers' default Qwen3.5 text shape (32 layers, 3 linear : 1 full, H = 4096), the 27B one, or a tiny one."""
    import transformers

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16) if tiny else dict(HYBRID_27B if big else {})
    if hasattr(transformers, "Qwen3_5TextConfig"):
        return transformers.Qwen3_5TextConfig(vocab_size=vocab_size or 248320, **small)
    # Older transformers: Qwen3-Next, made dense (every layer a plain MLP) to match the Qwen3.5 body.
    layers = small.get("num_hidden_layers", 32)
    defaults = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                    linear_key_head_dim=128, linear_value_head_dim=128)
    return transformers.Qwen3NextConfig(vocab_size=vocab_size or 151936, mlp_only_layers=list(range(layers)),
                                        **{**defaults, **small})


def build_model(config, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModel

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype)
    return model.eval()


def body_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def fla_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None
