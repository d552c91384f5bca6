"""A SpecForge 0.2.0 ``FeatureStore`` that serves an hsx run in place, and the run's ``SampleRef`` list.

SpecForge's offline trainer reads features through a ``FeatureStore`` (``get(ref) -> tensors, handle``)
from a list of metadata-only ``SampleRef``s; ``specforge.launch.build_disagg_offline_runtime`` takes both
from the caller (``feature_store=``, ``refs=``). ``HsxFeatureStore`` is that store for an hsx run, and
``run_refs`` the list: ref i is sample i of the run (line i of its index), its URI ``hsx://<run>/<i>``.
The tensors are the records of SpecForge's offline files, with their raw keys (hsx_tools/specforgerecord.py:
the one definition, which `hsx export --for specforge-*` writes too), so its own normalizers and collators apply.

Reads go through hsx_reader (see hsx_peers.samples for the bytes read and the digests of each fetch mode).

``specforge train`` itself reads a run in place through this package's command, which runs SpecForge's
own CLI with two of its offline seams pointed at the run when ``data.hidden_states_path`` is ``hsx://R``:

    python -m hsx_peers.specforge train -c run.yaml --hsx-store s3://bucket/prefix [--hsx-fetch range] \
        [--hsx-cache-dir /nvme/hsx-cache] [--hsx-s3-endpoint-url URL] [section.field=value ...]

- ``specforge.launch.build_offline_runtime`` (the colocated offline trainer over a ``LocalFeatureStore`` of
  ``.ckpt`` files) hands over to SpecForge's ``build_disagg_offline_runtime`` with an ``HsxFeatureStore``
  of run R and ``run_refs`` (same trainer assembly, same arguments);
- ``specforge.training.assembly._ensure_offline_vocab_mapping`` (EAGLE-3's draft vocabulary, counted from
  the feature files) counts the same loss-masked ``input_ids`` from the run's token columns (range reads,
  no hidden state read) and installs the map with SpecForge's own ``_install_dataset_vocab_mapping``.

Any other ``data.hidden_states_path`` is left to SpecForge (an ``hsx export`` folder trains as usual).

A run read in place whose config sets neither ``model.draft_model_config`` nor
``model.draft_checkpoint_path`` gets the draft config ``hsx export`` would write beside an export
(hsx_tools.draftconfig: the target's sizes from the model the run's manifest names, or from
``model.target_model_path`` where this machine cannot read that one; the run's layer ids where SpecForge
reads them) for ``eagle3``, ``dflash`` and ``dspark``, written to ``<output_dir>/draft_config.json`` and
passed as ``model.draft_model_config=<path>`` (the line is printed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from specforge.runtime.contracts import SCHEMA_VERSION, FeatureHandle, SampleRef
from specforge.runtime.data_plane.feature_store import FeatureStore

from hsx.errors import ConfigError
from hsx_peers.samples import open_run, token_columns
from hsx_reader import ReaderError
from hsx_tools import draftconfig
from hsx_tools.specforgerecord import KEYS, NEEDS_FINAL, specforge_record


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
        features = specforge_record(self.dataset()[int(uri[len(prefix):])], self.strategy)
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


RUN_SCHEME = "hsx://"


class RunSource:
    """Where ``hsx://R`` paths of a SpecForge config are read: the store and how to fetch from it."""

    def __init__(self, store: str, fetch: str = "object", cache_dir: str | None = None,
                 endpoint_url: str | None = None):
        self.store, self.fetch, self.cache_dir, self.endpoint_url = store, fetch, cache_dir, endpoint_url

    def run_of(self, hidden_states_path: str) -> str | None:
        """R for ``hsx://R``; None for any other path (an export folder: SpecForge's own reader)."""
        if not hidden_states_path.startswith(RUN_SCHEME):
            return None
        run = hidden_states_path[len(RUN_SCHEME):].strip("/")
        if not run or "/" in run:
            raise ReaderError(f"data.hidden_states_path {hidden_states_path!r}: expected hsx://<run>")
        return run

    def feature_store(self, run: str, strategy: str) -> HsxFeatureStore:
        return HsxFeatureStore(self.store, run, strategy, self.fetch, self.cache_dir, self.endpoint_url)


def token_counts(ds, max_length: int | None) -> Counter:
    """Loss-masked token id -> count over the run, each sample cut to ``max_length`` as SpecForge's
    ``count_effective_feature_tokens`` counts its feature files (read by range: no hidden state)."""
    counts: Counter = Counter()
    columns = token_columns(ds)
    for ids, mask in zip(columns["input_ids"], columns["loss_mask"], strict=True):
        counts.update(t for t, m in zip(ids[:max_length], mask[:max_length], strict=True) if m)
    return counts


_SOURCE: list[RunSource] = []   # the source the installed seams read (install() sets it; one per process)


def install(source: RunSource) -> None:
    """Point SpecForge's two offline seams at ``source`` for ``hsx://R`` paths (module docstring)."""
    installed = bool(_SOURCE)
    _SOURCE[:] = [source]
    if installed:
        return
    import specforge.launch as launch
    import specforge.training.assembly as assembly
    from specforge.algorithms.contracts import FeatureMode

    offline_runtime, vocab_mapping = launch.build_offline_runtime, assembly._ensure_offline_vocab_mapping

    def build_offline_runtime(*, hidden_states_path: str, **kwargs):
        source = _SOURCE[0]
        run = source.run_of(hidden_states_path)
        if run is None:
            return offline_runtime(hidden_states_path=hidden_states_path, **kwargs)
        store = source.feature_store(run, kwargs["algorithm"].name)
        refs = run_refs(store, ttt_length=kwargs.get("ttt_length", 7), max_len=kwargs.get("max_len", 2048))
        return launch.build_disagg_offline_runtime(feature_store=store, refs=refs, **kwargs)

    def ensure_offline_vocab_mapping(cfg, bundle, algorithm):
        source = _SOURCE[0]
        run = source.run_of(cfg.data.hidden_states_path)
        if run is None:
            return vocab_mapping(cfg, bundle, algorithm)
        # SpecForge's own conditions for building a map (assembly._ensure_offline_vocab_mapping)
        if (FeatureMode.OFFLINE not in algorithm.providers.vocab_mapping_modes or cfg.model.vocab_mapping_path
                or bundle.draft_vocab_size == bundle.target_vocab_size):
            return None
        ds = source.feature_store(run, algorithm.name).dataset()
        digests = hashlib.sha256(json.dumps(sorted(ds.index.digests.items())).encode()).hexdigest()
        identity = json.dumps({"kind": "hsx-run-v1", "store": source.store, "run": run, "objects": digests,
                               "max_length": cfg.data.max_length}, sort_keys=True)
        return assembly._install_dataset_vocab_mapping(cfg, bundle, counts=token_counts(ds, cfg.data.max_length),
                                                       dataset_identity=identity)

    launch.build_offline_runtime = build_offline_runtime
    assembly._ensure_offline_vocab_mapping = ensure_offline_vocab_mapping


class SpawnRefused(Exception):
    """specforge train would start processes of its own CLI, which would not read hsx://."""


def _refuse_spawning(plan) -> int:
    """Stands in for ``specforge.launch_plan.run_commands(plan)``, which would start those processes."""
    raise SpawnRefused(
        "this config makes specforge train launch processes of its own CLI (several ranks, or a producer "
        "and a consumer), which do not read hsx:// paths: run one process per rank under torchrun instead "
        "(torchrun --nproc_per_node N -m hsx_peers.specforge train ...; SpecForge then trains in each rank's "
        "process)")


def draft_override(argv: list[str], source: RunSource) -> str | None:
    """``model.draft_model_config=<path>`` for a config of ``specforge train`` argv that reads a run in place and
    names no draft config nor checkpoint: the run's draft config, written to ``<output_dir>/draft_config.json``;
    None otherwise (SpecForge resolves the draft as usual)."""
    from specforge.config import load_config

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-c", "--config")
    known, other = parser.parse_known_args(argv)
    if not known.config:
        return None
    cfg = load_config(known.config, [a for a in other if "=" in a and not a.startswith("-")])
    run, strategy = source.run_of(cfg.data.hidden_states_path), cfg.training.strategy
    if (run is None or cfg.model.draft_model_config or cfg.model.draft_checkpoint_path
            or strategy not in draftconfig.ARCHITECTURES):
        return None
    index = source.feature_store(run, strategy).dataset().index
    path = Path(cfg.output_dir) / draftconfig.FILE
    # the target's sizes: from the model the run's manifest names, else (a path of the extraction host that this
    # machine lacks) from the run config's own target
    models = [m for m in dict.fromkeys([index.manifest.model, cfg.model.target_model_path]) if m]
    for i, model in enumerate(models):
        try:
            draftconfig.write_draft_config(path, model, strategy, index.layer_ids)
            break
        except ConfigError:   # the draft cannot read the run's layers: the same for any model
            raise
        except (OSError, ValueError) as exc:
            if i == len(models) - 1:
                raise ConfigError(f"cannot read the target config of {model!r} ({exc}); set "
                                  "model.draft_model_config") from None
    line = draftconfig.config_line(path)
    print(f"draft config for run {run} ({model}, layers {index.layer_ids}): {line}", flush=True)
    return line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m hsx_peers.specforge",
        description="specforge train, reading data.hidden_states_path: hsx://R from an hsx store in place; "
                    "every other flag and override is specforge train's")
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--hsx-store", required=True, help="the run's store: a directory or s3://bucket/prefix")
    parser.add_argument("--hsx-fetch", choices=["object", "range"], default="object")
    parser.add_argument("--hsx-cache-dir", default=None, help="keep fetched objects here (object fetch)")
    parser.add_argument("--hsx-s3-endpoint-url", default=None)
    args, rest = parser.parse_known_args(argv)
    install(RunSource(args.hsx_store, args.hsx_fetch, args.hsx_cache_dir, args.hsx_s3_endpoint_url))
    import specforge.launch_plan as launch_plan
    from specforge.cli import main as specforge_main

    launch_plan.run_commands = _refuse_spawning  # the CLI takes it from there when it would launch processes
    try:
        draft = draft_override(rest, _SOURCE[0])
        return specforge_main(["train", *rest, *([draft] if draft else [])])
    except (SpawnRefused, ReaderError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
