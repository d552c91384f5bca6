"""An FP8 checkpoint's bare forward against bf16 and FP8 compute from bf16 weights, same batches, one process.

    python bench/fp8_checkpoint.py --shape qwen3-8b --tokens 150000 --out DIR [--layers N] [--ckpt-dir DIR]

Builds the shape with random weights (bf16) and writes its e4m3 128x128 block-scaled checkpoint, laid out as
the published FP8 releases (gpu_worker.fp8compute.fp8_tensors, quantised on the device one weight at a time, and
fp8_config), to ``--ckpt-dir`` (a tmpfs: no slow disk in the figures), then loads it back as the worker does
(gpu_worker.fp8compute.load_fp8_checkpoint: e4m3 values and block scales straight to Fp8Linear layers, never a bf16
copy). Three bodies, each cut to the layers the dflash pipeline runs:

- bf16: the random weights;
- FP8 compute: the same weights built again and converted (``--compute-dtype float8`` of a bf16 checkpoint);
- FP8 checkpoint: the loaded one (``--compute-dtype float8`` of an FP8 checkpoint).

The mix-32k batches are bench/fp8_speed.py's (lognormal lengths, seed 1, 32k tokens a batch). Each body is
warmed over every batch shape, then the three are timed round robin, ``--rounds`` passes each (CUDA synced,
real tokens/s). Also: the checkpoint's bytes, write and load seconds, and the GPU memory the load took at its
peak and kept (no bf16 copy: the peak stays near the FP8 body's own size). Writes fp8_checkpoint_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import shapes  # noqa: E402
import torch  # noqa: E402

from gpu_worker import fp8compute, fp8linear  # noqa: E402
from gpu_worker.extractor import _decoder  # noqa: E402
from hsx.defaults import DEFAULT_FP8_ACCUMULATION, FP8_ACCUMULATIONS  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx.prep.planning import cut_batches  # noqa: E402

GIB = 2 ** 30


def write_checkpoint(model, config, path: Path) -> dict:
    """``model``'s body as an e4m3 block-scaled checkpoint in ``path`` (keys as a CausalLM's: ``model.*``)."""
    from safetensors.torch import save_file

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    t = time.perf_counter()
    tensors = {key: value.cpu() for key, value in
               fp8compute.fp8_tensors({prefix + k: v for k, v in model.state_dict().items()})}
    quantise_s = time.perf_counter() - t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(path))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(fp8compute.fp8_config(cfg), indent=2))
    return {"quantised_weights": sum(k.endswith(".weight_scale_inv") for k in tensors),
            "bytes": (path / "model.safetensors").stat().st_size, "quantise_s": quantise_s,
            "write_s": time.perf_counter() - t}


def cut(model, layer_ids):
    decoder = _decoder(model)
    decoder.layers = decoder.layers[: max(layer_ids) + 1]
    return decoder


@torch.inference_mode()
def timed_pass(decoder, inputs, sync) -> tuple[float, torch.Tensor]:
    sync()
    t = time.perf_counter()
    out = None
    for ids in inputs:
        out = decoder(input_ids=ids, use_cache=False).last_hidden_state
    sync()
    return time.perf_counter() - t, out


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / a.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=shapes.SHAPES)
    ap.add_argument("--layers", type=int, default=0, help="build the shape with this many layers (0: its own)")
    ap.add_argument("--tokens", type=int, default=150_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ckpt-dir", default="/dev/shm/hsx-fp8-checkpoint")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--fp8-accumulation", choices=FP8_ACCUMULATIONS, default=DEFAULT_FP8_ACCUMULATION,
                    help="how both FP8 bodies' GEMMs accumulate, as `hsx produce --fp8-accumulation`")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    fast = args.fp8_accumulation == "fast"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
    config = shapes.make_config(args.shape, vocab_size=1024 if args.shape.startswith("tiny") else None)
    if args.layers:  # layer_types follows (its pattern repeated)
        types = getattr(config, "layer_types", None)
        config.num_hidden_layers = args.layers
        if types:
            config.layer_types = [types[i % len(types)] for i in range(args.layers)]
    layer_ids, _ = resolve_layers("dflash", config.num_hidden_layers)
    result = {"shape": args.shape, "layers_built": config.num_hidden_layers, "torch": torch.__version__,
              "fp8_accumulation": args.fp8_accumulation, "quantiser": fp8linear.QUANTISER,
              "share_inputs": fp8linear.SHARE_INPUTS}
    ckpt = Path(args.ckpt_dir)
    t0 = time.perf_counter()
    try:
        bf16 = shapes.build_model(config, device, torch.bfloat16)
        result["build_s"] = time.perf_counter() - t0
        result["checkpoint"] = write_checkpoint(bf16, config, ckpt)
        print(f"[fp8_checkpoint] built {result['build_s']:.1f}s; checkpoint {result['checkpoint']}", flush=True)
        bodies = {"bf16": cut(bf16, layer_ids)}

        before = allocated()
        converted = shapes.build_model(config, device, torch.bfloat16)
        bodies["FP8 compute (from bf16 weights)"] = cut(converted, layer_ids)
        n = fp8linear.convert_linears(bodies["FP8 compute (from bf16 weights)"].layers, fast_accum=fast)
        if cuda:
            torch.cuda.empty_cache()
        result["fp8_compute_gib"] = (allocated() - before) / GIB

        before = allocated()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        loaded = fp8compute.load_fp8_checkpoint(str(ckpt), device, fast_accum=fast)
        sync()
        result["load"] = {"seconds": time.perf_counter() - t, "fp8_linears": loaded.config.hsx_fp8_linears,
                          "kept_gib": (allocated() - before) / GIB,
                          "peak_gib": ((torch.cuda.max_memory_allocated(device) - before) / GIB) if cuda else 0.0}
        bodies["FP8 checkpoint"] = cut(loaded, layer_ids)
        print(f"[fp8_checkpoint] FP8 compute: {n} linears converted, {result['fp8_compute_gib']:.2f} GiB; "
              f"FP8 checkpoint load {result['load']}", flush=True)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)

    lengths = harness.lengths_for("mix", args.tokens, seed=1)
    batches = cut_batches(lengths, 32768, 512, 8)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, min(1000, config.vocab_size), (len(b.members), b.padded_len), generator=gen).to(device)
              for b in batches]
    real = sum(b.tokens for b in batches)
    result.update(batches=len(batches), layers_kept=len(bodies["bf16"].layers), real_tokens=real,
                  computed_tokens=sum(ids.numel() for ids in inputs))
    last = {}
    for name, decoder in bodies.items():  # every batch shape once per body, off the clock
        s, last[name] = timed_pass(decoder, inputs, sync)
        print(f"[fp8_checkpoint] warm {name}: {s:.1f}s", flush=True)
    runs = {name: [] for name in bodies}
    for r in range(args.rounds):
        for name, decoder in bodies.items():
            s, _ = timed_pass(decoder, inputs, sync)
            runs[name].append(real / s)
            print(f"[fp8_checkpoint] round {r + 1} {name}: {real / s:.0f} tok/s", flush=True)
    base = sum(runs["bf16"]) / len(runs["bf16"])
    result["bodies"] = {}
    for name, rates in runs.items():
        mean = sum(rates) / len(rates)
        result["bodies"][name] = {"tok_s": mean, "rounds": rates, "x_bf16": mean / base,
                                  "last_rel_l2_vs_bf16": rel_l2(last["bf16"], last[name])}
    result["ckpt_vs_compute_rel_l2"] = rel_l2(last["FP8 compute (from bf16 weights)"], last["FP8 checkpoint"])
    if cuda:
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    (out / f"fp8_checkpoint_{args.shape}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.shape}, {result['layers_kept']} of {result['layers_built']} layers kept, {len(batches)} mix-32k "
          f"batches, {real} real tokens, {args.rounds} rounds")
    print(f"{'body':<34} {'tok/s':>8} {'x bf16':>7} {'last rel L2 vs bf16':>20}")
    for name, r in result["bodies"].items():
        print(f"{name:<34} {r['tok_s']:>8.0f} {r['x_bf16']:>7.3f} {r['last_rel_l2_vs_bf16']:>20.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
