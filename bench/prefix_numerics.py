"""Is a sample continued from a shared prefix as near the truth as the same sample computed alone? (issue 40)

    python bench/prefix_numerics.py [--layers 16] [--hidden 256]

On a GPU, reused and lone samples of the 27B differ (bench/prefix_reuse.py: rel L2 8e-3 at the first stored
layer to 6e-2 at the last in bf16, 0.06 to 0.38 in FP8, random weights), while a sample in a plain batch equals
itself alone bit for bit. Computing a sample in two pieces (the spine, then the rest from its cached states)
rounds differently from one piece, so some difference is expected; the question is whether reuse moves the
sample away from the truth. A GPU cannot run the 27B in fp32, so this measures it here, on a random Qwen3.5
text model (Gated DeltaNet layers, every 4th full attention) on the CPU through the worker's own extractor:
three samples sharing a 300-token spine, each per stored layer against the same model's fp32 forward alone,
computed alone and reused, in fp32, bf16 and FP8 compute (torch's CPU ``_scaled_mm``); and, for scale, a leaf
continued from another spine's states (the bug the exactness tests look for), and the Gated DeltaNet states
lost at the branch point. Transformers' own forward (no fla here); the fused kernels' path is compared with it
on the CPU by tests/test_kernels.py.

What it shows: reuse leaves a sample as near fp32 as computing it alone does, in bf16 and in FP8. What it also
shows: on random weights the Gated DeltaNet layers add little to the residual stream, so even states zeroed at
the branch point move a whole sample by about bf16's own rounding. A whole-model comparison on random weights
(as bench/prefix_reuse.py's on the GPU) cannot tell a lost GDN state from rounding; the fp32 exactness tests
(atol 1e-5) and a module-level comparison can.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker import fp8compute, prefixrun  # noqa: E402
from gpu_worker.extractor import Extractor, pad_batch  # noqa: E402


def rel_l2(got: torch.Tensor, want: torch.Tensor, layers: int) -> list[float]:
    H = want.shape[1] // layers
    return [float((got[:, k * H:(k + 1) * H] - want[:, k * H:(k + 1) * H]).norm() / want[:, k * H:(k + 1) * H].norm())
            for k in range(layers)]


def worst(pairs, layers: int) -> list[float]:
    out = [0.0] * layers
    for got, want in pairs:
        out = [max(a, b) for a, b in zip(out, rel_l2(got.float(), want.float(), layers), strict=True)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--spine", type=int, default=300)
    args = ap.parse_args()
    import transformers

    torch.manual_seed(0)
    h = args.hidden
    cfg = transformers.Qwen3_5TextConfig(vocab_size=512, hidden_size=h, intermediate_size=3 * h,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=h // 4, linear_num_key_heads=2, linear_num_value_heads=4,
                                         linear_key_head_dim=h // 4, linear_value_head_dim=h // 4)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModel.from_config(cfg, dtype=torch.float32).eval()
    n = args.layers
    stored = sorted({1, n // 4, n // 2, 3 * n // 4, n - 1})
    gen = torch.Generator().manual_seed(1)
    rand = lambda k: torch.randint(0, 512, (k,), generator=gen)   # noqa: E731
    spine, other = rand(args.spine), rand(args.spine)
    rows = [torch.cat([spine, rand(k)]) for k in (200, 150, 77)]
    wrong_rows = rows + [torch.cat([other, rand(k)]) for k in (120, 90)]

    def packed(rs):
        return torch.cat(rs), torch.tensor([0, *torch.tensor([len(r) for r in rs]).cumsum(0).tolist()])

    def extractor(m, fp8: bool = False) -> Extractor:
        ex = Extractor(m, stored, False, out_dtype="float32", kernels="eager")
        if fp8:
            fp8compute.require_fp8_device = lambda device: None   # torch's CPU _scaled_mm: no tensor cores needed
            ex.fp8_pending = True
            ex.convert_to_fp8()
        return ex

    def lone(ex, rs):
        return [ex.run(pad_batch(r, torch.tensor([0, len(r)]), len(r), 0, pin=False))[0].clone() for r in rs]

    def reused(ex, rs, groups):
        ids, cu = packed(rs)
        hidden, _ = ex.run_shared(ids, cu, groups, 1 << 20)
        return [hidden[int(cu[i]):int(cu[i + 1])] for i in range(len(rs))]

    group = [[0, len(rows), args.spine]]
    ex32 = extractor(model)
    truth = lone(ex32, rows)
    table = [("fp32: reused vs lone", worst(zip(reused(ex32, rows, group), truth, strict=True), len(stored)))]
    for name, ex in (("bf16", extractor(copy.deepcopy(model).to(torch.bfloat16))),
                     ("FP8 compute", extractor(copy.deepcopy(model).to(torch.bfloat16), fp8=True))):
        alone, shared = lone(ex, rows), reused(ex, rows, group)
        table += [(f"{name}: lone vs fp32", worst(zip(alone, truth, strict=True), len(stored))),
                  (f"{name}: reused vs fp32", worst(zip(shared, truth, strict=True), len(stored))),
                  (f"{name}: reused vs lone", worst(zip(shared, alone, strict=True), len(stored)))]
    ex16 = extractor(copy.deepcopy(model).to(torch.bfloat16))
    real_add, first = prefixrun._Going.add, []

    def from_the_first_spine(going, cache, past, rows_):   # every group's rows from group 1's states
        if not first:
            first.append(cache)
        real_add(going, first[0], past, rows_)

    prefixrun._Going.add = from_the_first_spine
    try:
        wrong = reused(ex16, wrong_rows, [[0, 3, args.spine], [3, 2, args.spine]])[3:]
    finally:
        prefixrun._Going.add = real_add
    table.append(("bf16: a leaf from another spine's states vs lone",
                  worst(zip(wrong, lone(ex16, wrong_rows[3:]), strict=True), len(stored))))

    def zeroed_states(going, cache, past, rows_):   # the GDN layers' recurrent states lost at the branch point
        cache = copy.deepcopy(cache)
        for layer in cache.layers:
            states = getattr(layer, "recurrent_states", None)
            for key in (list(states) if isinstance(states, dict) else range(len(states or []))):
                if torch.is_tensor(states[key]):
                    states[key] = torch.zeros_like(states[key])
        real_add(going, cache, past, rows_)

    prefixrun._Going.add = zeroed_states
    try:
        lost = reused(ex16, rows, group)
    finally:
        prefixrun._Going.add = real_add
    table.append(("bf16: the GDN states zeroed at the branch point vs lone",
                  worst(zip(lost, lone(ex16, rows), strict=True), len(stored))))
    print(f"random Qwen3.5 text model, H {h}, {n} layers; 3 samples sharing a {args.spine}-token spine; "
          f"max rel L2 per stored layer {stored}")
    for name, errs in table:
        print(f"{name:56s} " + " ".join(f"{e:.1e}" for e in errs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
