"""Streaming over a completed run: whole batch objects, shuffled by object, split across ranks and workers.

Each epoch, the run's batch objects are put in an order fixed by (seed, epoch)
and dealt round-robin to the ``world_size * num_workers`` readers (reader
``rank * num_workers + worker_id`` takes objects ``r, r + R, r + 2R, ...``).
Every sample is therefore read exactly once per epoch across all ranks and
workers, each object by exactly one reader, fetched once. Rows within an
object are shuffled too. Readers get whole objects, so sample counts per
rank differ by up to one object's worth: a DDP loop must stop all ranks
together (e.g. ``torch.distributed`` all-reduce of a "done" flag, or a fixed
step count), not assume equal lengths.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hsx.runspec import Manifest
from hsx.store import Store, StoreSettings
from hsx_reader.run import Expectations
from hsx_reader.source import Source, sample_of


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class RunStream(IterableDataset):
    def __init__(self, store: Store | StoreSettings | str, run: str, expect: Expectations | None = None,
                 seed: int = 0, shuffle: bool = True, rank: int | None = None, world_size: int | None = None,
                 shards: list[str] | None = None, prefetch: int = 1, cache_bytes: int = 0,
                 cache_dir: Path | str | None = None, verify: bool = True):
        """``prefetch``: objects fetched ahead in a thread while the current one is consumed.
        ``cache_bytes``: keep objects across epochs (0: each epoch reads from the store again).
        ``verify``: each object must match the size and SHA-256 in the run's index (else CorruptBatch)."""
        self.source = Source(store, run, expect, cache_bytes, cache_dir, shards, verify)
        self.seed, self.shuffle, self.prefetch = seed, shuffle, prefetch
        self.rank, self.world_size = rank, world_size
        self.epoch = 0

    @property
    def manifest(self) -> Manifest:
        return self.source.index.manifest

    def set_epoch(self, epoch: int) -> None:
        """Call before iterating each epoch (DataLoader workers copy the dataset when iteration starts)."""
        self.epoch = epoch

    def keys_for(self, rank: int, world_size: int, worker_id: int = 0, num_workers: int = 1) -> list[str]:
        """The batch objects this reader gets this epoch, in reading order."""
        keys = self.source.index.keys()
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}").shuffle(keys)
        readers = world_size * num_workers
        return keys[rank * num_workers + worker_id::readers]

    def __iter__(self):
        rank, world_size = _rank_world(self.rank, self.world_size)
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        keys = self.keys_for(rank, world_size, worker_id, num_workers)
        groups = self.source.index.by_key()
        rng = random.Random(f"{self.seed}:{self.epoch}:{rank}:{worker_id}")
        for key, contents in self._batches(keys):
            refs = list(groups[key])
            if self.shuffle:
                rng.shuffle(refs)
            where = self.source.store.url(key)
            for ref in refs:
                yield sample_of(contents, ref, where)

    def _batches(self, keys: list[str]):
        if self.prefetch <= 0:
            for key in keys:
                yield key, self.source.batch(key)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="hsx-prefetch") as pool:
            ahead = [pool.submit(self.source.batch, k) for k in keys[:self.prefetch]]
            for i, key in enumerate(keys):
                if i + self.prefetch < len(keys):
                    ahead.append(pool.submit(self.source.batch, keys[i + self.prefetch]))
                yield key, ahead.pop(0).result()
