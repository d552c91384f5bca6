"""What fingerprinting a checkpoint's weights costs (hsx/prep/weights.py, ``blake3-v1``: every byte hashed).

1. The hash's rate: a file of ``--gb`` GB of random bytes is written in ``--dir`` and hashed as the fingerprint
   hashes a weight file (BLAKE3, ``update_mmap``), on 1 thread and on all of them, from the page cache (the
   file was just written; a worker hashes after the load, so its files are in the page cache too). Extrapolated
   to the seeds' target shape (Qwen3.5/3.6-27B text: 64 layers, H = 5120, 3 linear : 1 full attention; ~54 GB of
   bf16): the seconds it adds to a worker's start, against the load that reads the same bytes.
2. ``--full-shape``: that checkpoint as *sparse* safetensors files with real headers (no disk used, read as
   zeros: BLAKE3's rate does not depend on the bytes), fingerprinted in full, then again from the cache.

Usage::

    python bench/weights_fingerprint.py [--dir /tmp] [--gb 3] [--full-shape] [--shards 12]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from pathlib import Path

import blake3

from hsx.prep import weights

H, LAYERS, VOCAB, INTER, HEADS, KV, HEAD_DIM = 5120, 64, 248320, 17408, 24, 4, 256


def tensors() -> list[tuple[str, list[int]]]:
    """(name, shape) of every tensor of the shape, in checkpoint order (bf16)."""
    out = [("model.embed_tokens.weight", [VOCAB, H])]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [H]), (p + "post_attention_layernorm.weight", [H]),
                (p + "mlp.gate_proj.weight", [INTER, H]), (p + "mlp.up_proj.weight", [INTER, H]),
                (p + "mlp.down_proj.weight", [H, INTER])]
        if i % 4 == 3:  # full attention
            out += [(p + "self_attn.q_proj.weight", [2 * HEADS * HEAD_DIM, H]),
                    (p + "self_attn.k_proj.weight", [KV * HEAD_DIM, H]), (p + "self_attn.v_proj.weight", [KV * HEAD_DIM, H]),
                    (p + "self_attn.o_proj.weight", [H, HEADS * HEAD_DIM]),
                    (p + "self_attn.q_norm.weight", [HEAD_DIM]), (p + "self_attn.k_norm.weight", [HEAD_DIM])]
        else:          # gated delta net
            out += [(p + "linear_attn.in_proj_qkvz.weight", [12288, H]), (p + "linear_attn.in_proj_ba.weight", [96, H]),
                    (p + "linear_attn.conv1d.weight", [8192, 1, 4]), (p + "linear_attn.A_log", [48]),
                    (p + "linear_attn.dt_bias", [48]), (p + "linear_attn.norm.weight", [128]),
                    (p + "linear_attn.out_proj.weight", [H, 6144])]
    return out + [("model.norm.weight", [H]), ("lm_head.weight", [VOCAB, H])]


def write_sparse_shards(folder: Path, shards: int) -> int:
    """The checkpoint as sparse safetensors files; returns its size in bytes."""
    items = tensors()
    per = -(-len(items) // shards)
    total = 0
    for s in range(shards):
        header, offset = {}, 0
        for name, shape in items[s * per:(s + 1) * per]:
            n = 2
            for d in shape:
                n *= d
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path = folder / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + offset)
        total += 8 + len(raw) + offset
    return total


def hash_rate(folder: Path, gigabytes: float) -> dict[str, float]:
    """GB/s of BLAKE3 over a file of random bytes in the page cache: {"1 thread": .., "all threads": ..}."""
    path = folder / "hsx-fp-bench.bin"
    chunk = os.urandom(64 * 2**20)
    size = 0
    with open(path, "wb") as fh:
        while size < gigabytes * 1e9:
            fh.write(chunk)
            size += len(chunk)
    try:
        rates = {}
        for label, threads in (("1 thread", 1), ("all threads", blake3.blake3.AUTO)):
            started = time.perf_counter()
            blake3.blake3(max_threads=threads).update_mmap(str(path))
            rates[label] = size / 1e9 / (time.perf_counter() - started)
        return rates
    finally:
        path.unlink()


def shape_bytes() -> int:
    total = 0
    for _name, shape in tensors():
        n = 2
        for d in shape:
            n *= d
        total += n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--gb", type=float, default=3.0, help="size of the file whose hash rate is measured")
    parser.add_argument("--full-shape", action="store_true", help="also fingerprint the 27B shape as sparse files")
    parser.add_argument("--shards", type=int, default=12)
    args = parser.parse_args()
    size = shape_bytes()
    rates = hash_rate(args.dir, args.gb)
    print(f"BLAKE3 on {args.gb:g} GB in the page cache, {os.cpu_count()} CPUs: "
          + ", ".join(f"{label} {rate:.2f} GB/s" for label, rate in rates.items()))
    for label, rate in rates.items():
        print(f"  27B shape ({size / 1e9:.1f} GB, {len(tensors())} tensors): {size / 1e9 / rate:.1f} s on {label}; "
              f"the load reads the same bytes: {size / 1e9 / 2.0:.0f} s at 2 GB/s (NVMe), {size / 1e9 / 7.0:.0f} s at "
              "7 GB/s")
    if not args.full_shape:
        return
    folder = Path(tempfile.mkdtemp(prefix="hsx-fp-bench-", dir=args.dir))
    try:
        write_sparse_shards(folder, args.shards)
        for label in ("full read", "cached"):
            started = time.perf_counter()
            fingerprint = weights.weights_fingerprint(str(folder))
            print(f"  27B shape, sparse ({args.shards} shards), {label}: {time.perf_counter() - started:.2f} s: "
                  f"{fingerprint}")
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


if __name__ == "__main__":
    main()
