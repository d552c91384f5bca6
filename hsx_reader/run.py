"""A completed run as the reader sees it: manifest, index, and the caller's expectations.

Only the store is needed (``<run>/manifest.json`` and ``<run>/index.jsonl``);
Redis is not. The index lists samples in batch order: ``position`` i of the
run is line i of the index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from hsx.batch import VALUE_DTYPES as TORCH_DTYPES
from hsx.batch import dtype_name
from hsx.errors import HsxError
from hsx.runspec import Manifest, ManifestError
from hsx.store import ObjectNotFound, Store, layout


class ReaderError(HsxError, RuntimeError):
    """The run cannot be read as asked (missing, incomplete, corrupt, or not what the caller expects)."""


class RunMismatch(ReaderError):
    """The run's manifest does not match what the caller expects."""


@dataclass(frozen=True)
class SampleRef:
    """Where one sample lives: row ``row`` of the batch object ``key``."""

    position: int   # 0-based line of the index
    sample_id: str
    key: str        # store key of the batch object
    batch_id: str
    row: int        # sample b of the batch (rows cu_seqlens[b]:cu_seqlens[b+1])

    @property
    def shard(self) -> str:
        return self.key.rsplit("/", 2)[-2]


@dataclass(frozen=True)
class Expectations:
    """What a training job was built for; None = no opinion. ``check`` refuses any other run."""

    layer_ids: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | torch.dtype | None = None   # "bfloat16" or torch.bfloat16
    store_final: bool | None = None
    model_config_hash: str | None = None

    def check(self, manifest: Manifest, run: str) -> None:
        wanted = {"layer_ids": None if self.layer_ids is None else list(self.layer_ids),
                  "hidden_size": self.hidden_size, "dtype": _dtype_name(self.dtype),
                  "store_final": self.store_final, "model_config_hash": self.model_config_hash}
        has = {"layer_ids": list(manifest.layer_ids), "hidden_size": manifest.hidden_size, "dtype": manifest.dtype,
               "store_final": manifest.store_final, "model_config_hash": manifest.model_config_hash}
        diffs = [f"{k}: run has {has[k]!r}, expected {v!r}" for k, v in wanted.items() if v is not None and has[k] != v]
        if diffs:
            raise RunMismatch(f"run {run!r} is not what this reader expects:\n  " + "\n  ".join(diffs))


def _dtype_name(dtype) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    return dtype_name(dtype)


@dataclass
class RunIndex:
    """Manifest + index of one completed run in one store."""

    run: str
    manifest: Manifest
    samples: list[SampleRef]
    by_id: dict[str, SampleRef] = field(repr=False, default_factory=dict)
    digests: dict[str, tuple[int, str]] = field(repr=False, default_factory=dict)  # key -> (size, sha256 hex)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.manifest.layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.manifest.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.manifest.dtype]

    @property
    def store_final(self) -> bool:
        return self.manifest.store_final

    def keys(self) -> list[str]:
        """Batch object keys in index order, each once."""
        return list(dict.fromkeys(s.key for s in self.samples))

    def by_key(self) -> dict[str, list[SampleRef]]:
        groups: dict[str, list[SampleRef]] = {}
        for s in self.samples:
            groups.setdefault(s.key, []).append(s)
        return groups

    def only_shards(self, shards: list[str] | None) -> RunIndex:
        if not shards:
            return self
        keep = [s for s in self.samples if s.shard in set(shards)]
        return RunIndex(self.run, self.manifest, keep, {s.sample_id: s for s in keep}, self.digests)


def _get_json_bytes(store: Store, key: str, what: str) -> bytes:
    try:
        return store.get_bytes(key)
    except ObjectNotFound:
        raise ReaderError(f"{store.url(key)}: no {what}; is the run name right, and is the run complete "
                          "(the index is written when the last batch is verified)?") from None


def load_run(store: Store, run: str, expect: Expectations | None = None) -> RunIndex:
    """Read ``<run>/manifest.json`` and ``<run>/index.jsonl`` from ``store``; check ``expect``."""
    layout.check_run_name(run)
    key = layout.manifest_key(run)
    try:
        manifest = Manifest.from_json(_get_json_bytes(store, key, "manifest"), store.url(key))
    except ManifestError as exc:
        raise ReaderError(str(exc)) from None
    (expect or Expectations()).check(manifest, run)
    raw = _get_json_bytes(store, layout.index_key(run), "index")
    samples, digests = [], {}
    for n, line in enumerate(raw.decode().splitlines()):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            samples.append(SampleRef(len(samples), str(e["id"]), e["key"], e["batch_id"], int(e["row"])))
            if "sha256" in e:  # indexes written before digests were recorded lack them
                digests[e["key"]] = (int(e["size"]), str(e["sha256"]))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ReaderError(f"{store.url(layout.index_key(run))} line {n + 1}: bad entry ({exc})") from None
    by_id = {s.sample_id: s for s in samples}
    if len(by_id) != len(samples):
        raise ReaderError(f"{store.url(layout.index_key(run))}: sample ids repeat")
    return RunIndex(run, manifest, samples, by_id, digests)
