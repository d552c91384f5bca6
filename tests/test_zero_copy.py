"""Zero-copy training: the peers' own released code reads an hsx run in place through peers/hsx_peers, in the
peer's own venv (scripts/peers.sh), and trains; and what a sample costs to read, in bytes, against its size."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from hsx.store import LocalStore, Store
from hsx_reader import RunDataset

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"


def peer_python(name: str) -> Path:
    py = PEERS / name / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py} missing: run scripts/peers.sh (scripts/setup.sh --test does)")
    return py


def peer_env(tmp_path: Path) -> dict:
    """This checkout (hsx, hsx_reader, hsx_tools) and its plugin package on the peer venv's path."""
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'peers'}", "HOME": str(tmp_path),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}


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
def test_speculators_trains_in_place_through_the_hsx_backend(eagle3_run, tmp_path):
    py, env = peer_python("speculators"), peer_env(tmp_path)
    tokens = tmp_path / "tokens"
    out = subprocess.run([str(py), "-m", "hsx_peers.speculators", "tokens", "--store", str(eagle3_run.store),
                          "--run", eagle3_run.run, "--out", str(tokens)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
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
""", str(eagle3_run.store), eagle3_run.run, str(tokens)], env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    got = json.loads(check.stdout.strip().splitlines()[-1])
    want = RunDataset(str(eagle3_run.store), eagle3_run.run)[3]
    assert got["n"] == 160 and got["ids"] == want["input_ids"].tolist() and got["mask"] == want["loss_mask"].tolist()
    assert got["hs"] == list(want["hidden_states"].shape) and got["last"] == list(want["final_hidden_states"].shape)
    torch.testing.assert_close(torch.tensor(got["hs0"]), want["hidden_states"][0, :4].float())

    # speculators' own trainer, a few steps of a one-layer EAGLE-3 drafter: its Trainer moves the model to
    # cuda:<local_rank> (speculators/train/trainer.py setup_model) and has no CPU path
    has_cuda = subprocess.run([str(py), "-c", "import torch; print(torch.cuda.is_available())"], env=env,
                              capture_output=True, text=True, timeout=120).stdout.strip() == "True"
    if not has_cuda:
        pytest.skip("speculators 0.9.0's Trainer needs a CUDA device (model.to(local_rank)); its loader read the run above")
    train = subprocess.run([str(py), "-m", "hsx_peers.speculators", "train",
                            "--verifier-name-or-path", str(eagle3_run.model), "--data-path", str(tokens),
                            "--hidden-states-backend", "hsx", "--hsx-store", str(eagle3_run.store), "--hsx-run", eagle3_run.run,
                            "--speculator-type", "eagle3", "--num-layers", "1", "--total-seq-len", "512",
                            "--target-layer-ids", *[str(i + 1) for i in eagle3_run.layer_ids],
                            "--epochs", "1", "--max-steps", "6", "--lr", "3e-3", "--num-workers", "0", "--log-freq", "1",
                            "--hidden-states-dtype", "float32", "--draft-attn-impl", "sdpa", "--on-missing", "raise",
                            "--save-path", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")],
                           env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    log = train.stdout + train.stderr
    assert train.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"'train/loss': ([0-9.eE+-]+)", log)]
    print("speculators losses:", losses)
    assert len(losses) >= 3 and all(map(lambda x: x == x and abs(x) != float("inf"), losses)), log[-3000:]
    assert losses[-1] < losses[0], losses


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
                         capture_output=True, text=True, timeout=300)
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
