"""Packed rows against padded rows on the GPU: the same samples, the same fused kernels, per stored layer (issue 39).

    python bench/packed_parity.py                       # on a GPU with fla: 8 layers of the 27B's shape
    python bench/packed_parity.py --cpu --shape tiny-hybrid   # here: the reference kernels (torch maths)

`--kernels auto` runs a plain batch as one packed row: positions restart at each sample, the Gated DeltaNet's
conv and chunk kernels take the samples' bounds (fla's varlen form) and attention is torch's varlen flash
attention. This builds the first ``--layers`` layers of a shape with random weights, runs one batch of samples
(a sample of length 1, samples ending mid-chunk and on a chunk boundary, long ones) both ways through the same
Extractor, and prints per stored layer the rel L2 of packed against padded, and the worst sample's. bf16, then
FP8 compute (the linears converted as the worker does). Both ways are the same maths in other kernels (FA2
against cuDNN SDPA, fla varlen against batched), so a right packing differs by rounding; a sample that saw
another would differ by O(1) (tests/test_kernels.py's negative tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shapes  # noqa: E402

from gpu_worker import kernels  # noqa: E402
from gpu_worker.extractor import Extractor, pack_batch, pad_batch  # noqa: E402

LENGTHS = [1, 37, 64, 65, 300, 1000, 2047, 4096]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def compare(ex: Extractor, ids: torch.Tensor, cu: torch.Tensor, pin: bool) -> dict:
    padded_len = -(-max(LENGTHS) // 8) * 8
    packed, packed_final = ex.run(pack_batch(ids, cu, pin))
    packed = torch.cat([packed, packed_final], dim=1) if packed_final is not None else packed
    padded, padded_final = ex.run(pad_batch(ids, cu, padded_len, 0, pin))
    padded = torch.cat([padded, padded_final], dim=1) if padded_final is not None else padded
    H = ex.hidden_size
    layers = [rel(packed[:, i * H:(i + 1) * H], padded[:, i * H:(i + 1) * H]) for i in range(packed.shape[1] // H)]
    bounds = cu.tolist()
    samples = [rel(packed[s:e], padded[s:e]) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return {"layers": layers, "samples": samples, "finite": bool(torch.isfinite(packed).all())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="hybrid27b")
    ap.add_argument("--layers", type=int, default=8, help="the shape's first N layers (every 4th is attention)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--computes", default="bf16,fp8")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda:0")
    config = shapes.make_config(args.shape, vocab_size=512 if args.shape.startswith("tiny") else None)
    config.num_hidden_layers = args.layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:args.layers]
    model = shapes.build_model(config, device, torch.float32 if args.cpu else torch.bfloat16)
    if args.cpu:   # no Triton here: the reference kernels stand in for fla's, the same glue
        reference = kernels.reference_for(model)
        kernels.choose = lambda mode, dev: (reference, "")
    layer_ids = list(range(1, args.layers, 2))
    ex = Extractor(model, layer_ids, store_final=True, out_dtype="float32" if args.cpu else "bfloat16")
    print(f"[packed] forward: {ex.kernels_line}", flush=True)
    if not ex.packs:
        print("[packed] this forward does not pack rows: nothing to compare", flush=True)
        return 1
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    ids = torch.randint(0, config.vocab_size, (int(cu[-1]),), generator=gen)
    results = {}
    for compute in args.computes.split(","):
        if compute == "fp8":
            if args.cpu:
                continue
            from gpu_worker import fp8linear

            fp8linear.convert_linears(ex.decoder.layers)
        results[compute] = compare(ex, ids, cu, pin=not args.cpu)
        print(f"[packed] {compute}: {json.dumps(results[compute])}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"packed_parity_{args.shape}.json").write_text(json.dumps(
        {"shape": args.shape, "layers": args.layers, "lengths": LENGTHS, "stored": layer_ids + ["final"],
         "device": "cpu" if args.cpu else torch.cuda.get_device_name(0), "forward": ex.kernels_line,
         "results": results}, indent=1))
    print(f"\npacked against padded rows, {args.shape} ({args.layers} layers), samples of {LENGTHS} tokens")
    print(f"{'compute':<8} " + " ".join(f"{'L' + str(i):>9}" for i in layer_ids) + f" {'final':>9} {'worst sample':>13}")
    for compute, r in results.items():
        print(f"{compute:<8} " + " ".join(f"{x:>9.2e}" for x in r["layers"]) + f" {max(r['samples']):>13.2e}"
              + ("" if r["finite"] else "  NOT FINITE"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
