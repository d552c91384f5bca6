"""Map-style access to a completed run: ``ds[i]`` (position in the index) or ``ds.get(sample_id)``.

``fetch="object"`` reads whole batch objects through the bounded cache: best
when neighbouring positions are read together (a sequential or
batch-grouped sampler). ``fetch="range"`` reads only the sample's bytes (one
header read per object, then one range request per tensor): best for
uniformly random access to a remote store. Its token rows are checked against
the per-sample digest in the header; an object written before those digests
is checked by its batch's token digest (its token columns read once, ~5 bytes a
token), one written before any token digest is read whole. Its hidden-state rows
are checked against the per-sample CRC-32 in the header (hsx/batch/hidden.py);
an object written before those is read by range with its hidden states unchecked.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from torch.utils.data import Dataset

from hsx.runspec import Manifest
from hsx.store import Store, StoreSettings
from hsx_reader.cache import DEFAULT_CACHE_BYTES
from hsx_reader.objects import Header, check_against_run, check_sample_tokens, fetch_header, fetch_rows, fetch_token_columns, ranged
from hsx_reader.run import Expectations, ReaderError, SampleRef
from hsx_reader.source import Source, sample_of

HEADERS_KEPT = 4096  # parsed headers kept in range mode: ~194 bytes a sample (92 before the per-sample token
#                     digests): 25 MB for 32-sample batches, 400 MB at the 512-sample cap
TOKEN_COLUMNS_KEPT = 64  # batches' checked token columns kept in range mode (5 bytes a token; older objects only)


class RunDataset(Dataset):
    def __init__(self, store: Store | StoreSettings | str, run: str, expect: Expectations | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, cache_dir: Path | str | None = None,
                 fetch: str = "object", shards: list[str] | None = None, verify: bool = True):
        """``verify``: with ``fetch="object"``, each object must match the size and SHA-256 in the run's
        index or CorruptBatch is raised; with ``fetch="range"``, each sample's token rows must match the
        digest its object's header recorded for that sample (hsx/batch/tokens.py), its hidden-state rows
        the CRC-32 recorded for them (hsx/batch/hidden.py; objects written before it: unchecked), and its
        header and byte counts are checked. ``verify=False`` reads without digests in both modes."""
        if fetch not in ("object", "range"):
            raise ValueError(f"fetch must be 'object' or 'range', got {fetch!r}")
        self.source = Source(store, run, expect, cache_bytes, cache_dir, shards, verify)
        self.fetch = fetch
        self._headers: OrderedDict[str, Header] = OrderedDict()
        self._tokens: OrderedDict[str, dict] = OrderedDict()   # key -> checked token columns (_batch_tokens)

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
        checked = self.source.verify
        if not ranged(header) or (checked and header.meta.token_sha256 is None):
            # Compressed hidden states, or an object written before token digests: read whole (and checked
            # against the index's SHA-256).
            return sample_of(self.source.batch(ref.key), ref, self.source.store.url(ref.key))
        ids = header.sample_ids
        if ref.row >= len(ids) or ids[ref.row] != ref.sample_id:
            raise ReaderError(f"{self.source.store.url(ref.key)}: row {ref.row} is not sample {ref.sample_id!r}")
        hidden = [n for n in ("hidden_states", "final_hidden_states") if header.has(n)]
        if checked and header.meta.sample_token_sha256 is None:
            # Only the batch's token digest (written before the per-sample ones): the batch's token columns,
            # read once and checked, give this sample's tokens; its hidden states are read by range.
            tokens = self._batch_tokens(header)
            lo, hi = (int(x) for x in tokens["cu_seqlens"][ref.row:ref.row + 2])
            return {"sample_id": ref.sample_id, "input_ids": tokens["input_ids"][lo:hi],
                    "loss_mask": tokens["loss_mask"][lo:hi],
                    **fetch_rows(self.source.store, header, hidden, lo, hi, ref.row if checked else None)}
        cu = fetch_rows(self.source.store, header, ["cu_seqlens"], ref.row, ref.row + 2)["cu_seqlens"]
        lo, hi = int(cu[0]), int(cu[1])
        rows = fetch_rows(self.source.store, header, ["input_ids", "loss_mask"], lo, hi)
        if checked:   # the tokens first: their digest covers the row boundaries the hidden rows were read by
            check_sample_tokens(self.source.store, header, ref.row, {"cu_seqlens": cu, **rows})
        return {"sample_id": ref.sample_id, **rows,
                **fetch_rows(self.source.store, header, hidden, lo, hi, ref.row if checked else None)}

    def _batch_tokens(self, header: Header) -> dict:
        """The batch's token columns, checked against its header's token digest; the last few objects' kept."""
        tokens = self._tokens.get(header.key)
        if tokens is None:
            tokens = fetch_token_columns(self.source.store, header)
            self._tokens[header.key] = tokens
            if len(self._tokens) > TOKEN_COLUMNS_KEPT:
                self._tokens.popitem(last=False)
        self._tokens.move_to_end(header.key)
        return tokens
