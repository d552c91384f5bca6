"""What a dataset reads from: a store opened lazily in each process, plus its object cache.

Datasets are copied into DataLoader worker processes; a boto3 client must not
be shared across a fork or pickled, so the store is re-opened per process
from its settings (a ``Store`` instance passed in is used as is and must then
survive the copy: fine for ``LocalStore`` and forked workers).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hsx.batch import BatchContents
from hsx.store import Store, StoreSettings
from hsx_reader.cache import ByteCache
from hsx_reader.objects import CorruptBatch, check_digest, decode, fetch_object
from hsx_reader.run import Expectations, RunIndex, SampleRef, load_run


class Source:
    def __init__(self, store: Store | StoreSettings | str, run: str, expect: Expectations | None = None,
                 cache_bytes: int = 0, cache_dir: Path | str | None = None, shards: list[str] | None = None,
                 verify: bool = True):
        """``verify``: check each whole object against the size and SHA-256 the index recorded (default)."""
        self.verify = verify
        self.settings = StoreSettings(url=store) if isinstance(store, str) else store
        self.run, self.cache_bytes, self.cache_dir = run, cache_bytes, cache_dir
        self._store = store if isinstance(store, Store) else None
        self.index: RunIndex = load_run(self.store, run, expect).only_shards(shards)
        self._cache: ByteCache | None = None
        self._pid = os.getpid()

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = self.settings.open()
        return self._store

    @property
    def cache(self) -> ByteCache:
        if self._cache is None or self._pid != os.getpid():  # a fresh cache per process
            # On disk: this process's own folder under cache_dir, removed with the cache or at exit.
            self._cache, self._pid = ByteCache(self.cache_bytes, process_root=self.cache_dir), os.getpid()
        return self._cache

    def __getstate__(self):
        state = dict(self.__dict__)
        if isinstance(self.settings, StoreSettings):
            state["_store"] = None
        state["_cache"] = None
        return state

    def object_bytes(self, key: str) -> torch.Tensor:
        return self.cache.get(key, self._load)

    def _load(self, key: str) -> torch.Tensor:
        buf = fetch_object(self.store, key)
        digest = self.index.digests.get(key) if self.verify else None
        return check_digest(buf, self.store.url(key), *digest) if digest else buf

    def batch(self, key: str) -> BatchContents:
        """The decoded batch object at ``key``; tensors are views of the cached bytes."""
        return decode(self.object_bytes(key), self.store.url(key), self.index.manifest)


def sample_of(contents: BatchContents, ref: SampleRef, where: str) -> dict:
    """One sample's tensors as views of its batch: input_ids [T] int32, loss_mask [T] uint8,
    hidden_states [T, n*H], final_hidden_states [T, H] where stored."""
    if ref.row >= len(contents.sample_ids) or contents.sample_ids[ref.row] != ref.sample_id:
        raise CorruptBatch(f"{where}: row {ref.row} is not sample {ref.sample_id!r} as the index says")
    lo, hi = int(contents.cu_seqlens[ref.row]), int(contents.cu_seqlens[ref.row + 1])
    sample = {"sample_id": ref.sample_id, "input_ids": contents.input_ids[lo:hi],
              "loss_mask": contents.loss_mask[lo:hi], "hidden_states": contents.hidden_states[lo:hi]}
    if contents.final_hidden_states is not None:
        sample["final_hidden_states"] = contents.final_hidden_states[lo:hi]
    return sample
