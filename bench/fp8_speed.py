"""Where FP8 compute's time goes: the bare forward of one shape at bf16 and at FP8 variants, same batches.

    python bench/fp8_speed.py --shape qwen3-8b --tokens 150000 --out DIR [--profile]

Plans mix-32k batches (lognormal lengths, as gpu_bench.py's mix32k), builds the shape with random weights,
keeps the layers the dflash pipeline runs, warms every batch shape once at bf16 (fla compiles per shape),
then times one pass over all batches per variant (CUDA events; computed = padded tokens/s). Variants switch
gpu_worker/fp8linear.py's knobs: quantiser (compile / triton), shared input quantisation, fast accumulation, and the
narrowest linear converted. (Fused sibling GEMMs, q/k/v and gate/up as one GEMM, were measured slower with
commit d0c6b81's version of this script and removed.) ``--profile``: torch.profiler's kernel table of one batch
at bf16 and at the first and last FP8 variant. Also: the GEMM's accumulation error with and without fast
accumulation against an fp32 product of the same e4m3 operands. Writes fp8_speed_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402
import torch  # noqa: E402

from gpu_worker import fp8linear  # noqa: E402
from gpu_worker.extractor import _decoder  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx.prep.planning import cut_batches  # noqa: E402

# name: (quantiser, share inputs, fast accum, min features); "triton + shared input" is the default (fp32
# accumulation), "triton + shared + fast accum" is `hsx produce --fp8-accumulation fast`
VARIANTS = {
    "fp8 as landed (compiled quantiser)": ("compile", False, False, 16),
    "+ fast accum": ("compile", False, True, 16),
    "triton quantiser": ("triton", False, False, 16),
    "triton + shared input": ("triton", True, False, 16),
    "triton + shared + fast accum": ("triton", True, True, 16),
    "triton + shared + fast + >=512 only": ("triton", True, True, 512),
}


def set_structure(layers, min_features: int, device) -> None:
    """Every linear of at least ``min_features`` as an Fp8Linear (narrower ones back to bf16). Going back and
    forth re-quantises dequantised e4m3 weights: the same values, for speed runs."""
    fp8linear.convert_linears(layers, min_features=16)
    for parent in list(layers.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, fp8linear.Fp8Linear) and min(child.weight.shape) < min_features:
                lin = torch.nn.Linear(child.in_features, child.out_features, bias=False, device=device,
                                      dtype=torch.bfloat16)
                lin.weight.data = child.dequantised().bfloat16()
                setattr(parent, child_name, lin)
    torch.cuda.empty_cache()


def set_knobs(layers, quantiser: str, share: bool, fast: bool) -> None:
    fp8linear.QUANTISER, fp8linear.SHARE_INPUTS = quantiser, share
    for m in layers.modules():
        if isinstance(m, fp8linear.Fp8Linear):
            m.fast_accum = fast


@torch.inference_mode()
def timed_pass(decoder, inputs, real) -> dict:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = None
    for ids in inputs:
        out = decoder(input_ids=ids, use_cache=False).last_hidden_state
    end.record()
    torch.cuda.synchronize()
    s = start.elapsed_time(end) / 1000
    computed = sum(ids.numel() for ids in inputs)
    return {"seconds": s, "tok_s": real / s, "computed_tok_s": computed / s, "last": out}


@torch.inference_mode()
def profile_table(decoder, ids, path: Path, label: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    decoder(input_ids=ids, use_cache=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    with open(path, "a") as fh:
        fh.write(f"==== {label} {tuple(ids.shape)}\n{table}\n")
    return table


def accumulation_error(device) -> list[dict]:
    """rel L2 of _scaled_mm (rowwise) against fp32 of the same e4m3 operands, with and without fast accum."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for k, n in ((4096, 4096), (12288, 4096), (17408, 5120)):
        x = torch.randn(8192, k, device=device, generator=gen) * (1 + 20 * (torch.rand(k, device=device, generator=gen) > 0.995))
        w = torch.randn(n, k, device=device, generator=gen) / k ** 0.5
        xq, xs = fp8linear.quantise_rows(x.bfloat16())
        wq, ws = fp8linear.quantise_rows(w.bfloat16())
        ref = (xq.float() * xs) @ (wq.float() * ws).t()
        row = {"k": k, "n": n}
        for fast in (False, True):
            y = fp8linear.scaled_mm(xq, xs, wq, ws, None, torch.bfloat16, fast).float()
            row["fast" if fast else "exact"] = float((y - ref).norm() / ref.norm())
        y_bf16 = (x.bfloat16() @ w.bfloat16().t()).float()
        row["fp8_vs_bf16"] = float((ref - y_bf16).norm() / y_bf16.norm())
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=shapes.SHAPES)
    ap.add_argument("--tokens", type=int, default=150_000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda:0")
    result = {"shape": args.shape, "torch": torch.__version__, "variants": {}}
    if args.shape == "qwen3-8b":
        result["accumulation"] = accumulation_error(device)
        print(json.dumps(result["accumulation"]), flush=True)
    config = shapes.make_config(args.shape)
    model = shapes.build_model(config, device, torch.bfloat16)
    decoder = _decoder(model)
    layer_ids, _ = resolve_layers("dflash", config.num_hidden_layers)
    decoder.layers = decoder.layers[: max(layer_ids) + 1]
    lengths = harness.lengths_for("mix", args.tokens, seed=1)
    batches = cut_batches(lengths, 32768, 512, 8)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 1000, (len(b.members), b.padded_len), generator=gen).to(device) for b in batches]
    real = sum(b.tokens for b in batches)
    result.update(batches=len(batches), layers=len(decoder.layers), real_tokens=real)
    prof_path = out / f"fp8_profile_{args.shape}.txt"
    prof_path.unlink(missing_ok=True)
    t = time.perf_counter()
    timed_pass(decoder, inputs, real)  # every shape once: fla's kernels compile per shape
    print(f"[fp8_speed] {args.shape}: {len(batches)} batches, {len(decoder.layers)} layers, warm-up "
          f"{time.perf_counter() - t:.1f}s", flush=True)
    base = timed_pass(decoder, inputs, real)
    ref = base.pop("last").float()
    result["variants"]["bf16"] = base
    print(f"[fp8_speed] bf16: {base['tok_s']:.0f} tok/s", flush=True)
    if args.profile:
        profile_table(decoder, inputs[0], prof_path, "bf16")
    structure = None
    names = [n for n in args.variants.split(",") if n]
    for name in names:
        quantiser, share, fast, min_features = VARIANTS[name]
        if structure != min_features:
            set_structure(decoder.layers, min_features, device)
            structure = min_features
        set_knobs(decoder.layers, quantiser, share, fast)
        try:
            with torch.inference_mode():
                decoder(input_ids=inputs[0], use_cache=False)  # compile / autotune off the clock
            r = timed_pass(decoder, inputs, real)
        except Exception as exc:  # keep the other variants
            result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"[fp8_speed] {name}: FAILED {result['variants'][name]['error']}", flush=True)
            continue
        last = r.pop("last").float()
        r["rel_l2_vs_bf16"] = float((last - ref).norm() / ref.norm())
        r["x_bf16"] = r["tok_s"] / base["tok_s"]
        result["variants"][name] = r
        print(f"[fp8_speed] {name}: {r['tok_s']:.0f} tok/s, x{r['x_bf16']:.3f} of bf16, last-layer rel L2 vs "
              f"bf16 {r['rel_l2_vs_bf16']:.3f}", flush=True)
        if args.profile and name in (names[0], names[-1], "triton + shared + fast accum"):
            profile_table(decoder, inputs[0], prof_path, name)
    # quantiser parity: the Triton kernel against the reference on one activation
    for cols in (4096, 5120, 12288, 17408):
        xx = torch.randn(2048, cols, device=device, dtype=torch.bfloat16) * 3
        q1, s1 = fp8linear.quantise_rows(xx)
        q2, s2 = fp8linear._quantise_triton(xx)
        result.setdefault("quantiser_parity", []).append(
            {"cols": cols, "scale_max_rel": float(((s1 - s2).abs() / s1).max()),
             "values_differ": float((q1.float() != q2.float()).float().mean())})
    print(json.dumps(result.get("quantiser_parity")), flush=True)
    (out / f"fp8_speed_{args.shape}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'variant':<40} {'tok/s':>8} {'x bf16':>7} {'rel L2':>7}")
    for name, r in result["variants"].items():
        if "error" in r:
            print(f"{name:<40} FAILED")
        else:
            print(f"{name:<40} {r['tok_s']:>8.0f} {r.get('x_bf16', 1.0):>7.3f} {r.get('rel_l2_vs_bf16', 0.0):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
