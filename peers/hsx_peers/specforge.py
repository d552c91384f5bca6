"""A SpecForge 0.2.0 ``FeatureStore`` that serves an hsx run in place, and the run's ``SampleRef`` list.

SpecForge's offline trainer reads features through a ``FeatureStore`` (``get(ref) -> tensors, handle``)
from a list of metadata-only ``SampleRef``s; ``specforge.launch.build_disagg_offline_runtime`` takes both
from the caller (``feature_store=``, ``refs=``). ``HsxFeatureStore`` is that store for an hsx run, and
``run_refs`` the list: ref i is sample i of the run (line i of its index), its URI ``hsx://<run>/<i>``.
The tensors carry the raw keys of SpecForge's offline files, so its own normalizers and collators apply:

- ``strategy="eagle3"`` (run with the final state): ``input_ids`` [T] int64, ``loss_mask`` [T] int64,
  ``aux_hidden_state`` [1, T, n*H], ``hidden_state`` [1, T, H] (after the final norm, as SpecForge stores it);
- ``strategy="dflash"`` / ``"domino"``: ``input_ids``, ``loss_mask``, ``hidden_states`` [1, T, n*H];
- ``strategy="dspark"``: those plus ``target_last_hidden_states`` [1, T, H].

Reads go through hsx_reader (see hsx_peers.samples for the bytes read and the digests of each fetch mode).
"""

from __future__ import annotations

from typing import Any

import torch
from specforge.runtime.contracts import SCHEMA_VERSION, FeatureHandle, SampleRef
from specforge.runtime.data_plane.feature_store import FeatureStore

from hsx_peers.samples import open_run
from hsx_reader import ReaderError

KEYS = {
    "eagle3": ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"),
    "dflash": ("input_ids", "loss_mask", "hidden_states"),
    "domino": ("input_ids", "loss_mask", "hidden_states"),
    "dspark": ("input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"),
}
NEEDS_FINAL = {"eagle3", "dspark"}


def _features(sample: dict, strategy: str) -> dict[str, torch.Tensor]:
    out = {"input_ids": sample["input_ids"].to(torch.int64), "loss_mask": sample["loss_mask"].to(torch.int64)}
    if strategy == "eagle3":
        out["aux_hidden_state"] = sample["hidden_states"].clone()[None]
        out["hidden_state"] = sample["final_hidden_states"].clone()[None]
    else:
        out["hidden_states"] = sample["hidden_states"].clone()[None]
        if strategy == "dspark":
            out["target_last_hidden_states"] = sample["final_hidden_states"].clone()[None]
    return out


class HsxFeatureStore(FeatureStore):
    """Read-only: ``put`` is refused; ``release``/``abort`` free nothing (the run stays in the store)."""

    def __init__(self, store: str, run: str, strategy: str, fetch: str = "object", cache_dir: str | None = None,
                 endpoint_url: str | None = None):
        if strategy not in KEYS:
            raise ValueError(f"strategy must be one of {sorted(KEYS)}, got {strategy!r}")
        self.store, self.run, self.strategy = store, run, strategy
        self.fetch, self.cache_dir, self.endpoint_url = fetch, cache_dir, endpoint_url
        self._ds = None
        self._leases = 0

    def dataset(self):
        if self._ds is None:
            self._ds = open_run(self.store, self.run, self.fetch, self.cache_dir, self.endpoint_url)
            if self.strategy in NEEDS_FINAL and not self._ds.index.store_final:
                raise ReaderError(f"run {self.run!r} stores no final hidden state; SpecForge {self.strategy} needs it: "
                                  "extract with --layers eagle3 or a spec ending in +final")
        return self._ds

    def __getstate__(self):
        return {**self.__dict__, "_ds": None}

    def put(self, tensors, *, sample_id: str, metadata: dict[str, Any]) -> SampleRef:
        raise TypeError("HsxFeatureStore is read-only: an hsx run is written by hsx upload")

    def get(self, sample_ref: SampleRef, *, device="cpu", names=None):
        prefix = f"hsx://{self.run}/"
        uri = sample_ref.feature_store_uri
        if not uri.startswith(prefix):
            raise KeyError(f"{uri}: not a sample of hsx run {self.run!r}")
        features = _features(self.dataset()[int(uri[len(prefix):])], self.strategy)
        wanted = names or list(sample_ref.feature_keys)
        out = {n: features[sample_ref.feature_keys.get(n, n)].to(device) for n in wanted}
        self._leases += 1
        return out, FeatureHandle(sample_id=sample_ref.sample_id, generation=0, lease_token=f"{uri}:{self._leases}")

    def release(self, handle: FeatureHandle, *, reason: str = "consumed") -> None:
        """Nothing to free: the samples are views of (cached) batch objects."""

    def abort(self, sample_id: str, *, reason: str) -> None:
        """Nothing to evict: the run is read-only."""

    def health(self) -> dict[str, Any]:
        return {"store_id": f"hsx://{self.run}", "resident_samples": 0, "active_leases": 0, "resident_bytes": 0,
                "max_resident_bytes": None, "release_pending": 0}


def run_refs(store: HsxFeatureStore, ttt_length: int = 7, max_len: int = 2048) -> list[SampleRef]:
    """One metadata-only ref per sample of the run, in index order (no tensor is read)."""
    ds = store.dataset()
    keys = KEYS[store.strategy]
    return [SampleRef(sample_id=f"{store.run}:{ref.sample_id}", run_id=store.run, source_task_id=None,
                      feature_store_uri=f"hsx://{store.run}/{i}", feature_keys={k: k for k in keys}, feature_specs={},
                      strategy=store.strategy, schema_version=SCHEMA_VERSION,
                      metadata={"format": f"offline_{store.strategy}", "ttt_length": ttt_length, "max_len": max_len,
                                "file_index": i,
                                "target_repr": "hidden_state" if store.strategy in NEEDS_FINAL else None})
            for i, ref in enumerate(ds.index.samples)]
