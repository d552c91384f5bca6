"""Zero-copy training: the peers' own released code reads an hsx run in place through peers/hsx_peers, in the
peer's own venv (scripts/peers.sh), and trains; and what a sample costs to read, in bytes, against its size."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from hsx.runspec.config import StoreSettings
from hsx.store import LocalStore, Store
from hsx_reader import RunDataset
from tests.peerenv import peer_env, peer_python, run_peer
from tests.pipeline import run_pipeline
from tests.waiting import scaled


class CountingStore(Store):
    """A store that counts the bytes read through it, in front of a local one (not a LocalStore itself, so
    whole objects are read with get_bytes as from S3, not memory-mapped)."""

    def __init__(self, root: Path):
        self.inner, self.bytes_read = LocalStore(root), 0

    def get_bytes(self, key, start=None, end=None):
        data = self.inner.get_bytes(key, start, end)
        self.bytes_read += len(data)
        return data

    def url(self, key=""):
        return self.inner.url(key)

    def head(self, key):
        return self.inner.head(key)

    def list_keys(self, prefix):
        return self.inner.list_keys(prefix)

    def put_bytes(self, key, data):
        raise AssertionError("read only")

    put_file = delete = put_bytes


def _sample_bytes(sample: dict) -> int:
    return sum(t.numel() * t.element_size() for k, t in sample.items() if isinstance(t, torch.Tensor))


def test_bytes_read_per_sample(eagle3_run):
    plain = RunDataset(str(eagle3_run.store), eagle3_run.run)
    store = CountingStore(eagle3_run.store)
    ranged = RunDataset(store, eagle3_run.run, fetch="range")
    order = torch.randperm(len(ranged), generator=torch.Generator().manual_seed(0)).tolist()
    ranged[order[0]]                      # the first read of an object also reads its header: count it apart
    over, headers = [], set()
    for i in order:
        ref = ranged.index.samples[i]
        before = store.bytes_read
        sample = ranged[i]
        read = store.bytes_read - before
        size = _sample_bytes({k: v for k, v in plain[i].items()})
        if ref.key in headers:
            over.append(read - size)   # cu_seqlens' two rows (16 bytes) are all that is read beyond the sample
        headers.add(ref.key)
        assert torch.equal(sample["hidden_states"], plain[i]["hidden_states"])
    assert over and max(over) == 16 and min(over) == 16, over
    # object mode: each object read once, its digest checked; an epoch reads the run's bytes once
    whole = RunDataset(store, eagle3_run.run, fetch="object", cache_bytes=2**30)
    store.bytes_read = 0                  # after the manifest and index
    total = sum(_sample_bytes(whole[i]) for i in order)
    run_bytes = sum(size for size, _ in whole.index.digests.values())
    assert store.bytes_read == run_bytes
    print(f"range: sample bytes + 16 (+ header once per object); object: {run_bytes} bytes read for {total} bytes "
          f"of samples ({run_bytes / total:.3f}x, headers and cu_seqlens)")


@pytest.mark.slow
def test_speculators_dataset_reads_in_place_through_the_hsx_backend(eagle3_run, tmp_path):
    py, env = peer_python("speculators"), peer_env(tmp_path)
    tokens = tmp_path / "tokens"
    out = subprocess.run([str(py), "-m", "hsx_peers.speculators", "tokens", "--store", str(eagle3_run.store),
                          "--run", eagle3_run.run, "--out", str(tokens)], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout + out.stderr
    # token_freq.pt beside the token table, as the export writes it: token id -> count over loss-masked tokens
    freq, run_ds = torch.load(tokens / "token_freq.pt", weights_only=True), RunDataset(str(eagle3_run.store), eagle3_run.run)
    want_freq: dict[int, int] = {}
    for i in range(len(run_ds)):
        sample = run_ds[i]
        for token in sample["input_ids"][sample["loss_mask"].bool()].tolist():
            want_freq[token] = want_freq.get(token, 0) + 1
    assert freq == want_freq and sum(freq.values()) > 0
    # the peer's own dataset class reads sample i through the backend: same tensors as the run
    check = subprocess.run([str(py), "-c", """
import sys, json, torch
import hsx_peers.speculators  # registers the backend
from hs_connectors import HiddenStatesBackend
from speculators.train.data import ArrowDataset
import argparse
args = argparse.Namespace(hsx_store=sys.argv[1], hsx_run=sys.argv[2], hsx_fetch="range", hsx_cache_dir=None,
                          hsx_s3_endpoint_url=None)
transfer = HiddenStatesBackend.registry["hsx"].from_train_args(args, sys.argv[3])
ds = ArrowDataset(max_len=4096, datapath=sys.argv[3], transfer=transfer, on_missing="raise")
item = ds[3]
print(json.dumps({"n": len(ds), "hs": list(item["hidden_states"].shape), "last": list(item["verifier_last_hidden_states"].shape),
                  "ids": item["input_ids"].tolist(), "mask": item["loss_mask"].tolist(), "hs0": item["hidden_states"][0, :4].tolist()}))
""", str(eagle3_run.store), eagle3_run.run, str(tokens)], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert check.returncode == 0, check.stdout + check.stderr
    got = json.loads(check.stdout.strip().splitlines()[-1])
    want = RunDataset(str(eagle3_run.store), eagle3_run.run)[3]
    assert got["n"] == 160 and got["ids"] == want["input_ids"].tolist() and got["mask"] == want["loss_mask"].tolist()
    assert got["hs"] == list(want["hidden_states"].shape) and got["last"] == list(want["final_hidden_states"].shape)
    torch.testing.assert_close(torch.tensor(got["hs0"]), want["hidden_states"][0, :4].float())


STEPS = 5


@pytest.mark.slow
def test_speculators_trainer_trains_in_place_on_the_cpu(redis_server, eagle3_run, s3_server, s3_bucket, tmp_path):
    """`speculators train` itself (tests/peers/train_speculators.py: its config resolution, Trainer, drafter and
    data path; a CPU device shim only) reads two runs in place through the `hsx` backend, no export: a bf16 run
    in a local store and an FP8-stored one (e4m3 + per-token scales) on S3 (moto), a few steps each."""
    s3 = StoreSettings(url=f"s3://{s3_bucket}/runs", endpoint_url=s3_server, region="us-east-1")
    cases = {"bf16 local": ("bfloat16", str(tmp_path / "store")), "fp8 e4m3 on S3 (moto)": ("float8_e4m3", s3)}
    flag_lists, token_commands = [], []
    try:
        for i, (store_dtype, store) in enumerate(cases.values()):
            run = f"zc{i}"
            run_pipeline(redis_server.url, eagle3_run.model, store, tmp_path / f"spool-{run}", run=run, layers="eagle3",
                         dtype="bfloat16", store_dtype=store_dtype)
            url = store.url if isinstance(store, StoreSettings) else store
            endpoint = ["--hsx-s3-endpoint-url", s3_server] if isinstance(store, StoreSettings) else []
            tokens = tmp_path / f"tokens-{run}"
            # the run's tokens, in the peer's process, while the next run is extracted here
            token_commands.append(subprocess.Popen(
                [str(peer_python("speculators")), "-m", "hsx_peers.speculators", "tokens", "--store", url, "--run", run,
                 "--out", str(tokens), *(["--s3-endpoint-url", s3_server] if endpoint else [])],
                env=peer_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            flag_lists.append([
                "--verifier-name-or-path", str(eagle3_run.model), "--speculator-type", "eagle3", "--data-path", str(tokens),
                "--hidden-states-backend", "hsx", "--hsx-store", url, "--hsx-run", run, "--hsx-fetch", "range", *endpoint,
                "--target-layer-ids", *[str(x + 1) for x in eagle3_run.layer_ids], "--on-missing", "raise",
                "--max-steps", str(STEPS), "--epochs", "1", "--num-workers", "0", "--total-seq-len", "256",
                "--save-path", str(tmp_path / f"ckpt-{run}"), "--lr", "1e-2", "--log-freq", "1",
                "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--seed", "0"])
        for command in token_commands:
            said, _ = command.communicate(timeout=scaled(300))
            assert command.returncode == 0, said
    finally:
        for command in token_commands:
            if command.poll() is None:
                command.kill()
                command.wait()
    got = run_peer("speculators", "train_speculators.py", json.dumps(flag_lists), cwd=tmp_path)
    report = dict(zip(cases, got["losses"], strict=True))
    print("\nspeculators train, reading hsx runs in place (hsx backend, CPU):")
    print(f"{'case':<24}{'steps':>6}{'first loss':>12}{'last loss':>12}")
    for case, losses in report.items():
        print(f"{case:<24}{len(losses):>6}{losses[0]:>12.6f}{losses[-1]:>12.6f}")
    for case, losses in report.items():
        assert len(losses) == STEPS, (case, losses)
        assert all(math.isfinite(x) for x in losses), (case, losses)
        assert losses[-1] < losses[0], (case, losses)


SPECFORGE_LOADER = """
import sys, json, torch
from hsx_peers.specforge import HsxFeatureStore, run_refs
from specforge.algorithms.builtin import builtin_algorithm_registry
from specforge.launch import _offline_io
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
store_url, run, strategy = sys.argv[1:4]
algorithm = builtin_algorithm_registry().resolve(strategy)
collate_fn, transform = _offline_io(algorithm, "text", 512, ttt_length=1, use_usp_preprocess=False)
store = HsxFeatureStore(store_url, run, strategy, fetch="range")
refs = run_refs(store, ttt_length=1, max_len=512)
loader = FeatureDataLoader(store, refs=refs[:8], batch_size=2, collate_fn=collate_fn, per_sample_transform=transform,
                           drop_last=False, strategy=strategy)
batches = list(loader)
first = batches[0].tensors if hasattr(batches[0], "tensors") else batches[0]
print(json.dumps({"refs": len(refs), "batches": len(batches),
                  "shapes": {k: list(v.shape) for k, v in first.items() if hasattr(v, "shape")},
                  "ids0": first["input_ids"][0].tolist()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("which", ["eagle3", "dflash"])
def test_specforge_loader_reads_in_place_through_the_feature_store(which, eagle3_run, dflash_run, tmp_path):
    run = eagle3_run if which == "eagle3" else dflash_run
    py, env = peer_python("specforge"), peer_env(tmp_path)
    out = subprocess.run([str(py), "-c", SPECFORGE_LOADER, str(run.store), run.run, which], env=env,
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["refs"] == 160 and got["batches"] == 4, got
    want = RunDataset(str(run.store), run.run)[0]
    assert got["ids0"][:len(want["input_ids"])] == want["input_ids"].tolist()
    # SpecForge's own normalizers: eagle3 feeds the aux layers as hidden_state and the final state as target
    key = "hidden_state" if which == "eagle3" else "hidden_states"
    assert got["shapes"][key][-1] == want["hidden_states"].shape[-1], got
    if which == "eagle3":
        assert got["shapes"]["target"][-1] == want["final_hidden_states"].shape[-1], got
