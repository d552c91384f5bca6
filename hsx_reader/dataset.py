"""Map-style access to a completed run: ``ds[i]`` (position in the index) or ``ds.get(sample_id)``.

``fetch="object"`` reads whole batch objects through the bounded cache: best
when neighbouring positions are read together (a sequential or
batch-grouped sampler). ``fetch="range"`` reads only the sample's bytes (one
header read per object, then one range request per tensor): best for
uniformly random access to a remote store.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from torch.utils.data import Dataset

from hsx.runspec import Manifest
from hsx.store import Store, StoreSettings
from hsx_reader.cache import DEFAULT_CACHE_BYTES
from hsx_reader.objects import Header, check_against_run, fetch_header, fetch_rows, ranged
from hsx_reader.run import Expectations, ReaderError, SampleRef
from hsx_reader.source import Source, sample_of

HEADERS_KEPT = 4096  # parsed headers kept in range mode (a few KB each)


class RunDataset(Dataset):
    def __init__(self, store: Store | StoreSettings | str, run: str, expect: Expectations | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, cache_dir: Path | str | None = None,
                 fetch: str = "object", shards: list[str] | None = None, verify: bool = True):
        """``verify``: with ``fetch="object"``, each object must match the size and SHA-256 in the run's
        index or CorruptBatch is raised; ``fetch="range"`` reads parts of objects and checks only their
        header and the byte counts (a whole-object digest needs the whole object)."""
        if fetch not in ("object", "range"):
            raise ValueError(f"fetch must be 'object' or 'range', got {fetch!r}")
        self.source = Source(store, run, expect, cache_bytes, cache_dir, shards, verify)
        self.fetch = fetch
        self._headers: OrderedDict[str, Header] = OrderedDict()

    @property
    def index(self):
        return self.source.index

    @property
    def manifest(self) -> Manifest:
        return self.source.index.manifest

    def __len__(self) -> int:
        return len(self.source.index.samples)

    def __getitem__(self, position: int) -> dict:
        if not -len(self) <= position < len(self):
            raise IndexError(f"position {position} out of range for {len(self)} samples")
        return self._read(self.source.index.samples[position])

    def get(self, sample_id: str) -> dict:
        ref = self.source.index.by_id.get(str(sample_id))
        if ref is None:
            raise KeyError(f"sample {sample_id!r} is not in run {self.source.run!r}")
        return self._read(ref)

    def _read(self, ref: SampleRef) -> dict:
        if self.fetch == "object":
            return sample_of(self.source.batch(ref.key), ref, self.source.store.url(ref.key))
        return self._read_range(ref)

    def _header(self, key: str) -> Header:
        header = self._headers.get(key)
        if header is None:
            header = fetch_header(self.source.store, key)
            check_against_run(header, self.manifest)
            self._headers[key] = header
            if len(self._headers) > HEADERS_KEPT:
                self._headers.popitem(last=False)
        self._headers.move_to_end(key)
        return header

    def _read_range(self, ref: SampleRef) -> dict:
        header = self._header(ref.key)
        if not ranged(header):  # compressed hidden states: the object is read whole
            return sample_of(self.source.batch(ref.key), ref, self.source.store.url(ref.key))
        ids = header.sample_ids
        if ref.row >= len(ids) or ids[ref.row] != ref.sample_id:
            raise ReaderError(f"{self.source.store.url(ref.key)}: row {ref.row} is not sample {ref.sample_id!r}")
        cu = fetch_rows(self.source.store, header, ["cu_seqlens"], ref.row, ref.row + 2)["cu_seqlens"]
        lo, hi = int(cu[0]), int(cu[1])
        names = [n for n in ("input_ids", "loss_mask", "hidden_states", "final_hidden_states") if header.has(n)]
        rows = fetch_rows(self.source.store, header, names, lo, hi)
        return {"sample_id": ref.sample_id, **rows}
