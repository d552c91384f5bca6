"""Run in the speculators venv: speculators' own ArrowDataset, through the hs-connectors backend the export names
(file, or fp8 for an FP8 run), loads every sample of an hsx export. argv: OUT [REFERENCE_OUT]; with a reference
export (the bf16 run's), also the largest relative L2 error of the hidden states read against it."""

import argparse
import json
import sys
from pathlib import Path

import torch
from hs_connectors.transfer import HiddenStatesBackend
from speculators.train.data import ArrowDataset

out = Path(sys.argv[1])
info = json.loads((out / "hsx_export.json").read_text())
backend = info.get("hidden_states_backend", "file")


def dataset(root: Path, backend: str) -> ArrowDataset:
    transfer = HiddenStatesBackend.registry[backend].from_train_args(
        argparse.Namespace(hidden_states_path=str(root)), str(root / "dataset"))
    return ArrowDataset(max_len=4096, datapath=str(root / "dataset"), transfer=transfer, on_missing="raise")


ds = dataset(out, backend)
ref = dataset(Path(sys.argv[2]), "file") if len(sys.argv) > 2 else None
worst = 0.0
for i in range(len(ds)):
    item = ds[i]
    assert isinstance(item, dict), f"sample {i}: {item}"
    hs, last = item["hidden_states"], item["verifier_last_hidden_states"]
    T = item["input_ids"].shape[0]
    assert hs.shape == (T, 3 * info["hidden_size"]) and last.shape == (T, info["hidden_size"]), (hs.shape, last.shape)
    assert hs.dtype == torch.bfloat16 and bool(torch.isfinite(hs.float()).all())
    if ref is not None:
        want = ref[i]
        assert torch.equal(want["input_ids"], item["input_ids"])
        got_all = torch.cat([hs, last], 1).float()
        want_all = torch.cat([want["hidden_states"], want["verifier_last_hidden_states"]], 1).float()
        worst = max(worst, float((got_all - want_all).norm() / want_all.norm()))
print(json.dumps({"loaded": len(ds), "backend": backend, "rel_l2_vs_bf16": worst}))
