"""The fused Gated DeltaNet continuing a cached state, against the same layer over the whole sequence (issue 40).

    python bench/gdn_continue.py                 # on a GPU with fla: the 27B's GDN layer, fla's kernels
    python bench/gdn_continue.py --cpu --tiny    # here: the reference kernels (the same glue, torch maths)

A whole-model comparison on random weights cannot tell a lost GDN state from rounding (bench/prefix_numerics.py),
so this checks the one layer where a state matters most: one Gated DeltaNet layer of the 27B's shape with
hsx's fused forward (gpu_worker/kernels.py), fed the same random inputs twice: the whole sequence in one call,
and a prefix then the rest continued from the transformers cache the prefix left (conv window and recurrent
state; the cache expanded to two rows, as prefixrun expands a spine to its leaves). Per split point (mid-chunk,
on a chunk boundary, one token): the continued part's rel L2 against the one-call output, beside the same with
the recurrent state zeroed after the prefix (what a lost state looks like) and the fused one-call output against
transformers' own forward of the layer (the kernels' own rounding). A right continuation is near the rounding
column and far from the zeroed one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker import kernels  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="small dims (the CPU)")
    ap.add_argument("--tokens", type=int, default=1500)
    args = ap.parse_args()
    import transformers
    from transformers import DynamicCache

    device = torch.device("cpu" if args.cpu else "cuda:0")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    dims = (dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16) if args.tiny else
            dict(hidden_size=5120, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                 linear_value_head_dim=128))
    config = transformers.Qwen3_5TextConfig(vocab_size=256, intermediate_size=128, num_hidden_layers=1,
                                            layer_types=["linear_attention"], num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=16, **dims)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config, dtype=dtype).to(device).eval()
    layer = model.layers[0].linear_attn
    with torch.no_grad():   # a decay that keeps a state long enough to matter (random A_log, dt_bias)
        layer.A_log.uniform_(-2.0, 0.5)
        layer.dt_bias.uniform_(-1.0, 1.0)
    kernel_set, why = kernels.choose("auto", device)
    if kernel_set is None:
        if not args.cpu:
            raise SystemExit(f"no fused kernels here: {why}")
        import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

        kernel_set = kernels.reference_kernels(qwen.torch_chunk_gated_delta_rule)
    T, H = args.tokens, config.hidden_size
    import inspect

    keyword = "cache" if "cache" in inspect.signature(type(layer).forward).parameters else "cache_params"
    x = torch.randn(1, T, H, device=device, dtype=dtype)
    with torch.no_grad():
        eager = layer(hidden_states=x)
        installed = kernels.install(model, kernel_set)
        assert installed.get("gated_deltanet") == 1, installed
        whole = layer(hidden_states=x)
        print(f"{kernel_set.name}; GDN layer of H {H}, {T} tokens, {dtype}; rel L2 of the continued tokens against "
              f"the one-call output (fused one-call vs transformers' own: {rel(whole, eager):.1e})")
        print(f"{'split':>6} {'continued':>10} {'state zeroed':>13}")
        for split in (T // 2 + 7, 1024 if T > 1024 else 64, 1, T - 1):
            got = {}
            for zero in (False, True):
                cache = DynamicCache(config=config)
                layer(hidden_states=x[:, :split], **{keyword: cache})
                cache.reorder_cache(torch.zeros(2, dtype=torch.int64, device=device))   # a spine's two leaves
                if zero:
                    states = cache.layers[0].recurrent_states
                    for key in (list(states) if isinstance(states, dict) else range(len(states))):
                        states[key] = torch.zeros_like(states[key])
                rest = layer(hidden_states=x[:, split:].expand(2, -1, -1).contiguous(), **{keyword: cache})
                got[zero] = max(rel(rest[r:r + 1], whole[:, split:]) for r in range(2))
            print(f"{split:>6} {got[False]:>10.1e} {got[True]:>13.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
