"""Run in the specforge venv: specforge's own offline path for ALGORITHM (its registry's reader, normalizer and
collator, through its FeatureDataLoader over a LocalFeatureStore, as `specforge train` builds them) loads every
sample of an hsx export. argv: OUT ALGORITHM [OUT ALGORITHM ...] (ALGORITHM: eagle3 | dflash | dspark); prints
{OUT: {refs, batches, keys}} (JSON, last line)."""

import json
import os
import sys

import torch
from specforge.algorithms.builtin import builtin_algorithm_registry
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

os.environ["SPECFORGE_VALIDATE_OFFLINE_FEATURES"] = "1"  # its reader opens every file and checks keys up front


def load(out: str, name: str) -> dict:
    algorithm = builtin_algorithm_registry().resolve(name)
    provider = algorithm.providers.offline_for("text")
    refs = provider.build_reader(out, run_id="hsx", ttt_length=1, max_len=4096).read()
    loader = FeatureDataLoader(LocalFeatureStore("hsx"), refs=refs, batch_size=1, collate_fn=provider.build_collator(),
                               per_sample_transform=provider.build_normalizer(4096, ttt_length=1, use_usp_preprocess=False),
                               drop_last=False, strategy=name, num_workers=0)
    seen, keys = 0, set()
    for batch in loader:
        keys |= set(batch.tensors)
        for key, value in batch.tensors.items():
            if torch.is_tensor(value) and value.is_floating_point():
                assert bool(torch.isfinite(value.float()).all()), key
        seen += 1
    return {"refs": len(refs), "batches": seen, "keys": sorted(keys)}


print(json.dumps({out: load(out, name) for out, name in zip(sys.argv[1::2], sys.argv[2::2], strict=True)}))
