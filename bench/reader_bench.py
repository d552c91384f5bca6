"""Reader throughput on this machine (CPU only): samples/s and MB/s from a local directory and from S3.

    .venv/bin/python bench/reader_bench.py [--batches 12] [--token-budget 8192] [--workers 4]

Writes a synthetic run of a realistic shape (H = 4096, 5 layers, bf16; sample lengths lognormal, median ~600,
capped at 4096) with ``hsx.batch.batchfile.write_atomic`` into a temp dir, copies part of it into moto's S3 server on
loopback, and reads it back through a DataLoader (in-process, and with N worker processes) with
``collate_packed``, 8 samples a step, as a training loop would. MB/s counts the bytes of the samples delivered (hidden states, ids,
mask). The local numbers read through the page cache (the files were just written); prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from hsx.batch import BatchMeta, batchfile
from hsx.batch.dtypes import FP8, quantise_fp8
from hsx.runspec.config import StoreSettings
from hsx.runspec.manifest import RunLimits, new_manifest
from hsx.store import LocalStore, layout
from hsx_reader import RunStream, collate_packed

RUN, H, LAYERS = "bench", 4096, [1, 9, 17, 25, 33]


def write_run(root: Path, batches: int, token_budget: int, seed: int = 0, store_dtype: str = "bfloat16",
              codec: str = "none") -> int:
    rng = np.random.default_rng(seed)
    lines, total = [], 0
    for b in range(batches):
        lengths = []
        while True:
            n = int(min(4096, max(16, rng.lognormal(np.log(600), 0.8))))
            if sum(lengths) + n > token_budget and lengths:
                break
            lengths.append(n)
        n_tok = sum(lengths)
        ids = [f"s{b}-{i}" for i in range(len(lengths))]
        hidden = torch.randn(n_tok, len(LAYERS) * H).to(torch.bfloat16)
        tensors = {"hidden_states": hidden,
                   "input_ids": torch.randint(0, 150000, (n_tok,), dtype=torch.int32),
                   "loss_mask": torch.randint(0, 2, (n_tok,), dtype=torch.uint8),
                   "cu_seqlens": torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int64)}
        if store_dtype == FP8:
            tensors["hidden_states"], tensors["hidden_scales"] = quantise_fp8(hidden, len(LAYERS))
        bid = layout.batch_id(b)
        key = layout.batch_key(RUN, layout.shard_of(b, 100), bid)
        meta = BatchMeta(run=RUN, batch_id=bid, sample_ids=tuple(ids), layer_ids=tuple(LAYERS), dtype="bfloat16",
                         store_dtype=store_dtype, codec=codec, model="synthetic", hidden_size=H)
        batchfile.write_atomic(root / key, tensors, meta.to_metadata(), fsync=False, codec=codec)
        lines += [json.dumps({"id": s, "key": key, "batch_id": bid, "row": i}) for i, s in enumerate(ids)]
        total += len(ids)
    (root / layout.index_key(RUN)).write_text("\n".join(lines) + "\n")
    store = str(root)   # a synthetic run: what a reader checks is real, the rest says where it came from
    new_manifest(run=RUN, model="synthetic", model_config_hash="0" * 64, model_type="synthetic", num_layers=36,
                 hidden_size=H, layer_preset=",".join(map(str, LAYERS)), layer_ids=tuple(LAYERS), store_final=False,
                 dtype="bfloat16", store_dtype=store_dtype, codec=codec, compute_dtype="bfloat16", fp8_accumulation="fp32",
                 max_length=min(4096, token_budget),
                 overlong="drop", token_budget=token_budget, pad_multiple=8, max_batch_rows=512, batches_per_shard=100,
                 window_rows=None, dataset="synthetic", dataset_fingerprint="0" * 64, chat_template_hash="0" * 64,
                 template_kwargs={}, columns={}, pad_token_id=0, store_url=store, store=StoreSettings(url=store),
                 limits=RunLimits()).save(LocalStore(root))
    return total


def sample_bytes(s: dict) -> int:
    return sum(s[k].numel() * s[k].element_size() for k in ("hidden_states", "input_ids", "loss_mask"))


def measure(make_stream, workers: int) -> tuple[int, int, float]:
    """Packed batches of 8 samples delivered to this process (workers = 0: read and collate in it)."""
    loader = DataLoader(make_stream(), batch_size=8, num_workers=workers, collate_fn=collate_packed,
                        prefetch_factor=2 if workers else None)
    t0 = time.perf_counter()
    samples = nbytes = 0
    for batch in loader:
        samples += len(batch["sample_ids"])
        nbytes += sample_bytes({k: batch[k] for k in ("hidden_states", "input_ids", "loss_mask")})
    return samples, nbytes, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=12, help="batch objects in the local run")
    p.add_argument("--s3-batches", type=int, default=4, help="of them, copied to S3")
    p.add_argument("--token-budget", type=int, default=8192, help="tokens a batch object")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--formats", default="bfloat16/none",
                   help="comma list of STORE_DTYPE/CODEC, e.g. bfloat16/none,float8_e4m3/none,bfloat16/zstd,"
                        "float8_e4m3/zstd (S3 rows for the first only)")
    p.add_argument("--no-s3", action="store_true", help="local rows only (no moto server)")
    args = p.parse_args()
    rows = []
    for n, fmt in enumerate(args.formats.split(",")):
        store_dtype, codec = fmt.split("/")
        root = Path(tempfile.mkdtemp(prefix="hsx-reader-bench-"))
        try:
            total = write_run(root / "local", args.batches, args.token_budget, store_dtype=store_dtype, codec=codec)
            size = sum(f.stat().st_size for f in (root / "local").rglob("*.safetensors"))
            print(f"synthetic run {fmt}: {total} samples, {args.batches} objects, {size / 1e9:.2f} GB, H={H}, "
                  f"{len(LAYERS)} layers (random values: compression ratio not representative), {os.cpu_count()} CPUs")
            local = str(root / "local")
            for label, workers in (("local, in-process", 0), (f"local, {args.workers} workers", args.workers)):
                measure(lambda local=local: RunStream(local, RUN, seed=0), workers)  # warm-up (page cache, worker start)
                rows.append((f"{fmt}, {label}", size, *measure(lambda local=local: RunStream(local, RUN, seed=1), workers)))
            if n == 0 and not args.no_s3:
                rows += [(f"{fmt}, {label}", size, *rest) for label, *rest in s3_rows(root, args)]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| format, source | stored GB | samples | samples/s | MB/s delivered (bf16) |\n|---|---:|---:|---:|---:|")
    for label, size, samples, nbytes, secs in rows:
        print(f"| {label} | {size / 1e9:.2f} | {samples} | {samples / secs:,.0f} | {nbytes / secs / 1e6:,.0f} |")


def s3_rows(root: Path, args) -> list:
    from moto.server import ThreadedMotoServer

    from hsx.runspec.config import StoreSettings

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        settings = StoreSettings(url="s3://bench/p", endpoint_url=endpoint, region="us-east-1", addressing_style="path")
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        store = settings.open()
        keep = sorted((root / "local" / RUN / "batches").rglob("*.safetensors"))[:args.s3_batches]
        keys = {str(k.relative_to(root / "local")) for k in keep}
        for key in keys:
            store.put_bytes(key, (root / "local" / key).read_bytes())
        index = [ln for ln in (root / "local" / layout.index_key(RUN)).read_text().splitlines()
                 if json.loads(ln)["key"] in keys]
        store.put_bytes(layout.index_key(RUN), ("\n".join(index) + "\n").encode())
        store.put_bytes(layout.manifest_key(RUN), (root / "local" / layout.manifest_key(RUN)).read_bytes())
        return [("S3 (moto, loopback), in-process", *measure(lambda: RunStream(settings, RUN, seed=1), 0)),
                (f"S3 (moto, loopback), {args.workers} workers",
                 *measure(lambda: RunStream(settings, RUN, seed=1), args.workers))]
    finally:
        server.stop()


if __name__ == "__main__":
    main()
