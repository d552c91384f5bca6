"""What the hidden rows' per-sample CRC-32 (``sample_hidden_crc32``, hsx/batch/hidden.py) costs the writer thread.

Times ``sample_hidden_crcs`` (the encoder's call: zlib.crc32 over each sample's row slices of the host tensors,
no copy) on a [N, width] bf16 batch cut into samples of a typical length, against SHA-256 over the same bytes
(what a second cryptographic digest would cost on top of the file's), in CPU seconds per GiB of hidden states.
Prints one JSON line per sample length. CPU only; run it where the worker runs (the GPU host) for its figure:

    python bench/hidden_crc_cost.py --width 12288 --tokens 32768 --lengths 128,512,2048,8192 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

from hsx.batch.hidden import sample_hidden_crcs


def _cpu_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        fn()
        best = min(best, time.process_time() - started)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=12288, help="row width: layers x hidden size (3 x 4096: eagle3 8B)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens (rows) of the batch")
    ap.add_argument("--lengths", default="128,512,2048,8192", help="sample lengths in tokens, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    hidden = torch.randn(args.tokens, args.width).to(torch.bfloat16)
    gib = hidden.numel() * hidden.element_size() / 2**30
    whole = memoryview(hidden.reshape(-1).view(torch.uint8).numpy())
    sha = _cpu_seconds(lambda: hashlib.sha256(whole).digest(), args.repeat)
    for length in (int(x) for x in args.lengths.split(",")):
        bounds = list(range(0, args.tokens, length)) + [args.tokens]
        tensors = {"hidden_states": hidden, "cu_seqlens": torch.tensor(bounds, dtype=torch.int64)}
        crc = _cpu_seconds(lambda t=tensors: sample_hidden_crcs(t), args.repeat)
        print(json.dumps({"sample_tokens": length, "samples": len(bounds) - 1, "hidden_gib": round(gib, 3),
                          "crc32_cpu_s_per_gib": round(crc / gib, 3), "sha256_cpu_s_per_gib": round(sha / gib, 3),
                          "header_bytes_per_sample": 11}))


if __name__ == "__main__":
    main()
