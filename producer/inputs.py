"""A window's batch inputs, written to the store: ``<run>/inputs/<shard>/<batch id>.safetensors``
(hsx.store.layout).

Each object is a batch file (hsx.batch) holding the batch's packed ``input_ids`` (int32), ``loss_mask`` (uint8)
and ``cu_seqlens`` (int64, one more than its samples), its header naming the run, the batch id, the sample ids
and the padded length. The plan records its SHA-256 (``BatchSpec.input_sha256``).
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from hsx import life
from hsx.batch import InputsMeta, batch_bytes
from hsx.prep import PlannedBatch, Sample
from hsx.store import ObjectNotFound, Store, layout

log = logging.getLogger(__name__)
INPUT_UPLOAD_THREADS = 8   # objects written at once


def input_tensors(members: list[Sample]) -> dict[str, torch.Tensor]:
    lengths = [len(s.input_ids) for s in members]
    return {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in members])),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in members])),
        "cu_seqlens": torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int64),
    }


def write_inputs(store: Store, run: str, samples: list[Sample], planned: list[PlannedBatch],
                 specs: list[life.BatchSpec], done: set[str], suspect: frozenset[str]) -> list[life.BatchSpec]:
    """Put each batch's packed inputs in the store (skipping done batches and identical objects).

    An object counts as identical by its size and the SHA-256 the store reports (S3: the metadata written
    with it), except for ``suspect`` batches (a worker found their inputs corrupt): those objects are read
    back and hashed, since corruption at rest leaves the metadata as it was.
    Returns the specs with ``input_sha256`` set: workers check the inputs they read against it.
    """

    def put(i: int) -> life.BatchSpec:
        spec = specs[i]
        members = [samples[j] for j in planned[i].members]
        data = batch_bytes(input_tensors(members), InputsMeta(
            run=run, batch_id=spec.batch_id, sample_ids=tuple(spec.sample_ids), padded_len=spec.padded_len).to_metadata())
        sha = hashlib.sha256(data).hexdigest()
        if spec.batch_id not in done:
            key = layout.input_key(run, spec.shard, spec.batch_id)
            head = store.head(key)
            if head is None or head.size != len(data) or head.sha256 != sha or (
                    spec.batch_id in suspect and stored_sha256(store, key) != sha):
                store.put_bytes(key, data)
                if spec.batch_id in suspect:
                    log.warning("rewrote the input object %s of %s (its bytes differed from the plan's)",
                                store.url(key), spec.batch_id)
        return replace(spec, input_sha256=sha)

    out = []
    with ThreadPoolExecutor(INPUT_UPLOAD_THREADS) as pool:
        for n, spec in enumerate(pool.map(put, range(len(specs))), 1):
            out.append(spec)
            if n % 1000 == 0:
                log.info("wrote inputs of %d/%d batches", n, len(specs))
    return out


def stored_sha256(store, key: str) -> str | None:
    """SHA-256 of the object's bytes as the store returns them now (None if it is gone)."""
    try:
        return hashlib.sha256(store.get_bytes(key)).hexdigest()
    except ObjectNotFound:
        return None
