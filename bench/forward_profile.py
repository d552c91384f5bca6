"""Where the forward's GPU time goes, by kernel kind, and what each fused kernel buys (issue 39).

    python bench/forward_profile.py --shape hybrid27b --tokens 200000 --out DIR
    python bench/forward_profile.py --shape tiny-hybrid --cpu --out DIR     # the glue and the accounting, on the CPU

Builds the shape with random weights (weights do not change the compute), keeps the layers the dflash pipeline
runs (as gpu_worker/extractor.py does), plans mix-32k batches (bench/gpu_bench.py's lengths and budget) and, for
bf16 then FP8 compute (hsx's rowwise e4m3 linears), runs each variant of the forward over the same batches:

- ``eager``: transformers' forward (``hsx worker --kernels eager``, the path before issue 39);
- ``fused``: gpu_worker/kernels.py's kernels (``--kernels auto``, the default);
- with ``--levers``: the fused set one lever at a time on top of eager (norms, swiglu, gdn), so that each gain
  is attributed, not guessed;
- ``+ packed rows``: the fused set with each batch's samples as one packed row (the default's layout where it is
  exact: varlen attention and GDN, no padding computed).

Per variant: useful tok/s over one timed pass of all batches (CUDA events, after a warm pass: fla compiles per
shape), and a torch.profiler table of GPU time by kind (GEMM, GDN kernels, conv, attention, quantise, norm,
elementwise and copies, other) plus idle between kernels (wall - kernel time, profiler on). Then the parity of
every replaced module against the code it replaces, on a batch with padding, a sample of length 1 and samples
ending mid-chunk (fla's chunk is 64 tokens): rel L2 and max abs error over real tokens, bf16.

The table is printed last; JSON in DIR/forward_profile_<shape>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402
import torch  # noqa: E402

from gpu_worker import fp8linear, kernels  # noqa: E402
from gpu_worker.extractor import _decoder, decoder_packed  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx.prep.planning import cut_batches  # noqa: E402

# kind: substrings of a CUDA kernel's name, first match wins (lower case). "elementwise and copies" is the rest.
KINDS = (
    ("quantise", ("quantise_rows",)),
    ("GDN kernels", ("chunk_", "recompute_w_u", "solve_tril", "merge_16x16", "gdn_gate", "l2norm", "fused_beta",
                     "chunk_local_cumsum", "wy_fast", "kkt")),
    ("conv", ("causal_conv1d", "conv_depthwise", "depthwise", "conv1d", "implicit_convolve", "cudnn::conv", "convolve")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn_generated_fort_native_sdpa", "cudnn")),
    ("norm", ("layer_norm", "rms_norm", "layernorm", "norm_fwd")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "scaled_mm", "matmul", "cublas")),
    ("activation", ("swiglu", "silu", "sigmoid", "softplus")),
)
ORDER = ("GEMM", "GDN kernels", "conv", "attention", "quantise", "norm", "activation", "elementwise and copies", "idle")

LEVERS = {  # name: the kernel kinds of gpu_worker/kernels.py's tables installed (cumulative in this order)
    "+ fused norms and residual add": {"norm", "layer"},
    "+ swiglu": {"norm", "layer", "mlp"},
    "+ GDN conv, gating, gated norm (= fused)": {"norm", "layer", "mlp", "gated_deltanet"},
}
PACKED = "+ packed rows (varlen attention and GDN)"   # the fused set, each batch one packed row
FUSED = {"norm", "layer", "mlp", "gated_deltanet"}


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "elementwise and copies"


def install_subset(decoder, kernel_set, parts: set[str]) -> None:
    """gpu_worker/kernels.py's install, keeping only the module kinds in ``parts`` (for the levers)."""
    kernels.install(decoder, kernel_set)
    keep = {"norm": kernels.ZERO_CENTRED_NORMS | kernels.PLAIN_NORMS, "layer": kernels.DECODER_LAYERS,
            "mlp": kernels.GATED_MLPS, "gated_deltanet": kernels.GATED_DELTANETS}
    allowed = set().union(*(keep[p] for p in parts))
    for module in decoder.modules():
        if hasattr(module, "_hsx_eager") and type(module).__name__ not in allowed:
            kernels._unbind(module)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Batches:
    """The same batches padded ([rows, padded_len] ids) or packed (one row each, the plan's sample bounds), and
    one forward of either as the worker runs it."""

    def __init__(self, decoder, kernel_set, batches, lengths: list[int], vocab: int, device):
        from gpu_worker.extractor import pack_batch

        gen = torch.Generator().manual_seed(0)
        self.decoder, self.kernel_set, self.device = decoder, kernel_set, device
        self.padded = [torch.randint(0, vocab, (len(b.members), b.padded_len), generator=gen).to(device)
                       for b in batches]
        self.packed = []
        for b, ids in zip(batches, self.padded, strict=True):
            lengths_b = torch.tensor([lengths[i] for i in b.members], dtype=torch.int64)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths_b.cumsum(0)])
            real = torch.cat([ids[r, :int(n)].cpu() for r, n in enumerate(lengths_b)])
            self.packed.append(pack_batch(real, cu, pin=device.type == "cuda"))

    def items(self, packed: bool) -> list:
        return self.packed if packed else self.padded

    def forward(self, item) -> None:
        if torch.is_tensor(item):
            self.decoder(input_ids=item, use_cache=False)
            return
        decoder_packed(self.decoder, self.kernel_set, item, self.device)


def computed(item) -> int:
    return item.numel() if torch.is_tensor(item) else item.n_tokens


@torch.inference_mode()
def timed_pass(batches: Batches, items, real: int, device) -> dict:
    sync(device)
    t = time.perf_counter()
    for item in items:
        batches.forward(item)
    sync(device)
    s = time.perf_counter() - t
    return {"seconds": s, "tok_s": real / s, "computed_tok_s": sum(computed(i) for i in items) / s}


@torch.inference_mode()
def profile_kinds(batches: Batches, items, device) -> dict:
    """GPU time by kind over ``items`` (ms and share of wall), kernel launches, and idle = wall - kernel time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    sync(device)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for item in items:
            batches.forward(item)
        sync(device)
        wall_ms = (time.perf_counter() - t) * 1e3
    ms, launches, top = defaultdict(float), 0, defaultdict(float)
    for event in prof.key_averages():
        own = (event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total) / 1e3
        if own <= 0 or (device.type == "cpu" and not event.key.startswith("aten::")):
            continue
        ms[kind_of(event.key)] += own
        top[event.key[:60]] += own
        launches += event.count
    busy = sum(ms.values())
    ms["idle"] = max(0.0, wall_ms - busy)
    table = {k: {"ms": ms.get(k, 0.0), "share": ms.get(k, 0.0) / max(wall_ms, busy)} for k in ORDER}
    return {"wall_ms": wall_ms, "kernel_ms": busy, "busy": busy / wall_ms, "launches": launches, "kinds": table,
            "top": sorted(top.items(), key=lambda kv: -kv[1])[:12]}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _fp32(value):
    """``value`` (a tensor, or a tuple / list / dict of them) with floating tensors as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _fp32(v) for k, v in value.items()}
    return value


@torch.inference_mode()
def parity(decoder, kernel_set, device, vocab: int) -> list[dict]:
    """Every replaced module against the forward it replaces, on the inputs the eager model gives it: rows of
    lengths 1, 37, 64 + 17 and 300 right-padded to 320 (real tokens compared, bf16)."""
    lengths = [1, 37, 81, 300]
    T = 320
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=gen).to(device)
    real = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(device)
    kernels.install(decoder, kernel_set)
    replaced = [m for m in decoder.modules() if hasattr(m, "_hsx_eager")]
    captured = {}

    def keep_inputs(module, args, kw):
        captured.setdefault(module, (args, dict(kw)))

    handles = [m.register_forward_pre_hook(keep_inputs, with_kwargs=True) for m in replaced]
    kernels.uninstall(decoder)
    decoder(input_ids=ids, use_cache=False)   # eager: each module's real input
    for h in handles:
        h.remove()
    # fp32 truth for the first two instances of each class (bf16 models only: an fp32 copy of the module, eager)
    truth, per_class = {}, defaultdict(int)
    bf16 = not any(isinstance(m, fp8linear.Fp8Linear) for m in decoder.modules())
    for module in replaced:
        per_class[type(module).__name__] += 1
        if bf16 and module in captured and per_class[type(module).__name__] <= 2:
            args, kw = captured[module]
            truth[module] = _first(copy.deepcopy(module).float()(*_fp32(args), **_fp32(kw))).float()
    kernels.install(decoder, kernel_set)
    worst: dict[str, dict] = {}   # per module class: the instance with the largest rel L2
    vs32: dict[str, dict] = defaultdict(dict)   # per module class: the largest error against fp32, eager and fused
    for module in replaced:
        if module not in captured:
            continue
        kind = type(module).__name__
        args, kw = captured[module]
        want, got = _first(module._hsx_eager(*args, **kw)), _first(module.forward(*args, **kw))
        fp32 = truth.get(module)
        if want.dim() >= 3 and want.shape[:2] == real.shape:
            want, got = want[real], got[real]
            fp32 = fp32[real] if fp32 is not None else None
        diff = (got.float() - want.float())
        row = {"module": kind, "instances": worst.get(kind, {}).get("instances", 0) + 1,
               "shape": list(args[0].shape if args else kw["hidden_states"].shape),
               "rel_l2": float(diff.norm() / want.float().norm().clamp_min(1e-30)),
               "max_abs": float(diff.abs().max()), "ref_max": float(want.float().abs().max())}
        if fp32 is not None:   # each against fp32: the fused path must be no further from it than eager
            for key, value in (("eager_vs_fp32", want), ("fused_vs_fp32", got)):
                error = float((value.float() - fp32).norm() / fp32.norm().clamp_min(1e-30))
                vs32[kind][key] = max(error, vs32[kind].get(key, 0.0))
        if kind not in worst or row["rel_l2"] >= worst[kind]["rel_l2"]:
            worst[kind] = row
        worst[kind]["instances"] = row["instances"]
    kernels.uninstall(decoder)
    return [{**row, **vs32[kind]} for kind, row in worst.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="hybrid27b", choices=shapes.SHAPES)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--profile-batches", type=int, default=3, help="batches under the profiler, per variant")
    ap.add_argument("--computes", default="bf16,fp8")
    ap.add_argument("--levers", action="store_true", help="also each lever alone on top of eager")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU with kernels.reference_kernels")
    ap.add_argument("--cpu-bf16", action="store_true", help="with --cpu: the model in bf16 (parity against fp32)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.cpu else "cuda:0")
    dtype = torch.float32 if args.cpu and not args.cpu_bf16 else torch.bfloat16
    config = shapes.make_config(args.shape, vocab_size=512 if args.shape.startswith("tiny") else None)
    t = time.perf_counter()
    model = shapes.build_model(config, device, dtype)
    decoder = _decoder(model)
    layer_ids, _ = resolve_layers("dflash" if config.num_hidden_layers >= 8 else "dflash:3", config.num_hidden_layers)
    decoder.layers = decoder.layers[: max(layer_ids) + 1]
    if args.cpu:
        kernel_set = kernels.reference_for(model)
    else:
        kernel_set, why = kernels.choose("auto", device)
        if kernel_set is None:
            raise SystemExit(f"no fused kernels here: {why}")
    lengths = harness.lengths_for("mix", args.tokens, seed=1)
    budget = 32768 if not args.cpu else 2048
    batches = cut_batches(lengths, budget, 512, 8)
    vocab = config.vocab_size
    data = Batches(decoder, kernel_set, batches, lengths, min(vocab, 1000), device)
    real = sum(b.tokens for b in batches)
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(0) if not args.cpu else "cpu",
              "torch": torch.__version__, "kernels": kernel_set.name, "batches": len(batches),
              "layers": len(decoder.layers), "real_tokens": real, "build_s": time.perf_counter() - t,
              "variants": {}, "parity": {}}
    print(f"[profile] {args.shape}: {len(batches)} batches ({real} real tokens), {len(decoder.layers)} layers, "
          f"{kernel_set.name}", flush=True)
    variants = {"eager": None, "fused": FUSED}
    if args.levers:
        variants = {"eager": None, **LEVERS}
    kernels.install(decoder.layers, kernel_set)
    packs, why = kernels.packing_ready(decoder, kernel_set, device)
    kernels.uninstall(decoder.layers)
    if packs:
        variants[PACKED] = FUSED
    else:
        print(f"[profile] no packed rows here: {why}", flush=True)
    json_path = out / f"forward_profile_{args.shape}.json"
    for compute in args.computes.split(","):
        if compute == "fp8":
            if args.cpu:
                continue
            fp8linear.convert_linears(decoder.layers)
            torch.cuda.empty_cache()
        result["parity"][compute] = parity(decoder, kernel_set, device, min(vocab, 1000))
        for row in result["parity"][compute]:
            vs32 = (f"; vs fp32: eager {row['eager_vs_fp32']:.2e}, fused {row['fused_vs_fp32']:.2e}"
                    if "fused_vs_fp32" in row else "")
            print(f"[profile] parity {compute} {row['module']} (worst of {row['instances']}): rel L2 {row['rel_l2']:.2e}, "
                  f"max abs {row['max_abs']:.2e} (ref max {row['ref_max']:.2e}){vs32}", flush=True)
        for name, parts in variants.items():
            kernels.uninstall(decoder)
            if parts:
                install_subset(decoder, kernel_set, parts)
            items = data.items(packed=name == PACKED)
            t = time.perf_counter()
            timed_pass(data, items, real, device)  # warm: every shape compiles / autotunes off the clock
            warm_s = time.perf_counter() - t
            timed = timed_pass(data, items, real, device)
            prof = profile_kinds(data, items[: args.profile_batches], device)
            key = f"{compute} {name}"
            result["variants"][key] = {**timed, "warm_s": warm_s, **prof}
            print(f"[profile] {key}: {timed['tok_s']:.0f} tok/s (warm pass {warm_s:.1f}s), busy {prof['busy']:.1%}, "
                  f"{prof['launches']} launches; top {prof['top'][:4]}", flush=True)
            json_path.write_text(json.dumps(result, indent=1))
        kernels.uninstall(decoder)
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    variants = result["variants"]
    base = {}
    print(f"\n{result['shape']} on {result['device']}, {result['real_tokens']} real tokens in {result['batches']} "
          f"batches, {result['layers']} layers; GPU ms by kind (share of wall, profiler on)")
    print(f"{'variant':<46} {'tok/s':>7} {'x':>5} " + " ".join(f"{k[:10]:>16}" for k in ORDER))
    for key, v in variants.items():
        compute = key.split()[0]
        base.setdefault(compute, v["tok_s"])
        cells = " ".join(f"{v['kinds'][k]['ms']:>8.0f} ({v['kinds'][k]['share']:>4.1%})" for k in ORDER)
        print(f"{key:<46} {v['tok_s']:>7.0f} {v['tok_s'] / base[compute]:>5.2f} {cells}")


if __name__ == "__main__":
    sys.exit(main())
