"""FP8 error and lossless ratio on a briefly *trained* small model against its random init (CPU only).

    .venv/bin/python bench/activation_stats.py --minutes 4 --out bench-out/activations.json

Random-init activations have no outlier channels, so FP8 error and compression ratios measured on them
alone say little. This trains a small Qwen3 (H=256, 6 layers) on text for a few minutes (the shipped sample
conversations plus generated sentences), then for both the random init and the trained weights extracts the
dflash:3 layers of held-out text in bf16 (as a GPU worker stores them) and measures, per layer: FP8 e4m3
(one scale a token a layer) relative L2 and mean cosine against bf16, max|x| / rms (outliers), and the
zstd ratio (stored / raw) and single-thread compress/decompress speed of bf16 (byte planes and plain) and FP8.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hsx.batch.dtypes import fp8_error, quantise_fp8  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx_tools.demo import sample_dataset  # noqa: E402
from hsx_tools.tinymodel import build_tokenizer  # noqa: E402

WORDS = ("the model reads a long document and answers every question about its tables figures and code "
         "while the user asks for a summary of the results in three short points with numbers").split()


def texts(seed: int, n_generated: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for line in sample_dataset().read_text().splitlines():
        row = json.loads(line)
        out.append(" ".join(str(m.get("content") or m.get("value") or "")
                            for m in row.get("messages") or row.get("conversations") or []))
    for _ in range(n_generated):  # generated sentences: a little grammar, numbers, repeated structure
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 40))]
        out.append(f"Step {rng.randint(1, 99)}: " + " ".join(words) + f". Total = {rng.randint(0, 10**6)}.")
    rng.shuffle(out)
    return out


def zstd_stats(t: torch.Tensor, planes: bool) -> dict:
    import zstandard

    from hsx.batch import codec

    t = t.contiguous()
    raw_bytes = t.numel() * t.element_size()
    saved = codec.ZSTD_THREADS
    codec.ZSTD_THREADS = 0  # single-thread figures
    try:
        t0 = time.perf_counter()
        if planes:  # what hsx writes: byte planes, each a zstd frame or raw
            packed, table = codec.encode(t, "zstd")
        else:       # plain zstd over the bytes as they are
            packed = zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL).compress(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            table = None
        comp_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if planes:
            codec.decode(packed, "zstd", t.dtype, tuple(t.shape), planes=table)
        else:
            zstandard.ZstdDecompressor().decompress(packed)
        dec_s = time.perf_counter() - t0
    finally:
        codec.ZSTD_THREADS = saved
    n = packed.numel() if hasattr(packed, "numel") else len(packed)
    return {"ratio": n / raw_bytes, "compress_mb_s": raw_bytes / comp_s / 1e6, "planes": table,
            "decompress_mb_s": raw_bytes / dec_s / 1e6, "cpu_s_per_gb": comp_s / (raw_bytes / 1e9)}


@torch.no_grad()
def measure(model, tok, held_out: list[str], layer_ids: list[int]) -> dict:
    model.eval()
    hidden = []
    for text in held_out:
        ids = tok(text, return_tensors="pt").input_ids[:, :512]
        out = model.model(input_ids=ids, output_hidden_states=True)
        hidden.append(torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1))
    x = torch.cat(hidden).to(torch.bfloat16)  # what a GPU worker computes and stores by default
    q, scales = quantise_fp8(x, len(layer_ids))
    err = fp8_error(x, q, scales)
    H = x.shape[1] // len(layer_ids)
    per_layer = []
    for k, layer in enumerate(layer_ids):
        block = x[:, k * H:(k + 1) * H].float()
        rms = block.pow(2).mean().sqrt()
        per_layer.append({"layer": layer, "fp8_rel_l2": float(err[0, k]), "fp8_cosine": float(err[1, k]),
                          "max_over_rms": float(block.abs().max() / rms),
                          "channel_rms_max_over_median": float(block.pow(2).mean(0).sqrt().max()
                                                               / block.pow(2).mean(0).sqrt().median())})
    return {"tokens": x.shape[0], "layers": per_layer,
            "zstd_bf16_planes": zstd_stats(x, planes=True), "zstd_bf16_plain": zstd_stats(x, planes=False),
            "zstd_fp8": zstd_stats(q, planes=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=4.0, help="CPU training time")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="bench-out/activations.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    work = Path(args.out).parent / "activation-model"
    tok = build_tokenizer(work, vocab_size=2048, sample_path=sample_dataset())
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=args.hidden // 4, max_position_embeddings=4096, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    layer_ids, _ = resolve_layers("dflash:3", args.layers)
    corpus = texts(0, 20000)
    held_out, train = corpus[:40], corpus[40:]
    stream = torch.tensor([t for text in train for t in tok(text + "<|im_end|>").input_ids])
    result = {"config": vars(args), "layer_ids": layer_ids, "random_init": measure(model, tok, held_out, layer_ids)}
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    model.train()
    t0, step, losses = time.time(), 0, []
    while time.time() - t0 < args.minutes * 60:
        starts = torch.randint(0, len(stream) - args.seq - 1, (args.batch,))
        ids = torch.stack([stream[s:s + args.seq] for s in starts])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        step += 1
        if step % 25 == 0:
            print(f"step {step}: loss {sum(losses[-25:]) / 25:.3f} ({time.time() - t0:.0f}s)", flush=True)
    result["training"] = {"steps": step, "seconds": time.time() - t0, "loss_first": losses[0],
                          "loss_last25": sum(losses[-25:]) / len(losses[-25:])}
    result["trained"] = measure(model, tok, held_out, layer_ids)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name in ("random_init", "trained"):
        m = result[name]
        print(f"{name}: " + ", ".join(f"L{d['layer']} fp8 relL2 {d['fp8_rel_l2']:.4f} cos {d['fp8_cosine']:.5f} "
                                      f"max/rms {d['max_over_rms']:.0f}" for d in m["layers"]))
        print(f"  zstd ratio bf16 planes {m['zstd_bf16_planes']['ratio']:.3f} "
              f"(compress {m['zstd_bf16_planes']['compress_mb_s']:.0f} MB/s a thread), bf16 plain "
              f"{m['zstd_bf16_plain']['ratio']:.3f}, fp8 {m['zstd_fp8']['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
