"""What fingerprinting a checkpoint's weights costs (hsx/prep/weights.py): bytes read, reads, seconds.

Builds a checkpoint of the seeds' target shape (Qwen3.5/3.6-27B text: 64 layers, H = 5120, 3 linear : 1 full
attention; ~54 GB of bf16 in 12 safetensors shards) as *sparse* files with real headers, then fingerprints it.
Sparse files cost no disk and read as zeros: the seconds here are the reads' own cost from the page cache, not a
cold disk's. On a cold disk multiply the reads by its random-read latency (NVMe ~0.1 ms: ~0.2 s; a network file
system ~1 ms: ~2 s). Usage::

    python bench/weights_fingerprint.py [--dir /tmp/hsx-fp-bench] [--shards 12]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--shards", type=int, default=12)
    args = parser.parse_args()
    folder = args.dir or Path(tempfile.mkdtemp(prefix="hsx-fp-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    size = write_sparse_shards(folder, args.shards)
    reads: list[int] = []
    real = os.pread
    weights.os.pread = lambda fd, n, off: reads.append(n) or real(fd, n, off)
    try:
        started = time.perf_counter()
        fingerprint = weights.weights_fingerprint(str(folder))
        seconds = time.perf_counter() - started
    finally:
        weights.os.pread = real
    print(f"checkpoint {size / 1e9:.1f} GB, {len(tensors())} tensors in {args.shards} shards: read {sum(reads) / 2**20:.2f} "
          f"MiB in {len(reads)} reads, {seconds * 1000:.0f} ms (page cache / sparse; see the docstring for a cold "
          f"disk): {fingerprint}")
    for path in folder.glob("*.safetensors"):
        path.unlink()
    if args.dir is None:
        folder.rmdir()


if __name__ == "__main__":
    main()
