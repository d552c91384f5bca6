"""An hs-connectors backend named ``hsx``: speculators' own trainer reads an hsx run in place.

hs-connectors 0.9.0 registers a backend when its class is defined (``@HiddenStatesBackend.register``);
neither it nor speculators 0.9.0 looks for backends by entry point, and speculators snapshots the
registry when ``speculators.train.config.resolution`` is imported. So this module must be imported
first, which its command line does before it hands over to speculators' own ``main``:

    python -m hsx_peers.speculators tokens --store s3://bucket/prefix --run R --out /data/R-tokens
    python -m hsx_peers.speculators train --hidden-states-backend hsx --hsx-store s3://bucket/prefix \
        --hsx-run R --data-path /data/R-tokens --verifier-name-or-path <target> --speculator-type eagle3 ...
    (torchrun --nproc_per_node=8 -m hsx_peers.speculators train ... likewise)
    HSX_REDIS_URL=redis://ledger:6379/0 python -m hsx_peers.speculators train --hidden-states-backend hsx \
        --hsx-run R --hsx-mode follow ...      # train while R is extracted: hsx_peers.speculators_follow

``tokens`` writes speculators' Arrow dataset of the token columns only (input_ids, loss_mask, seq_len;
torch format; about 9 bytes a token against the run's tens of KB) and its ``token_freq.pt``. The hidden states stay in the store:
``get_cached(i)`` reads sample i of the run (line i of its index) through hsx_reader and gives
speculators its offline layout, ``hidden_states`` [T, n + 1, H] (the run's layers, then the final state)
and ``token_ids`` [T] int64, in the run's dtype (FP8 runs come back dequantised with their scales).
The last slot is the final state divided by the target's final-norm gain, as ``hsx export`` writes it:
speculators applies ``verifier_norm`` to it, which gives back the stored state.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from hsx.errors import HsxError
from hsx.runspec import with_redis_password
from hsx.store import StoreSettings
from hsx_peers.samples import open_run, token_columns
from hsx_peers.speculators_follow import FollowTransfer, install
from hsx_reader import ReaderError


class HsxTransfer(HiddenStatesTransfer):
    """Samples of one hsx run by index position. Opens the store lazily (once per DataLoader worker)."""

    def __init__(self, store: str, run: str, fetch: str = "object", cache_dir: str | None = None,
                 endpoint_url: str | None = None):
        self.store, self.run, self.fetch, self.cache_dir, self.endpoint_url = store, run, fetch, cache_dir, endpoint_url
        self._ds = None
        self._gain = None

    def setup(self) -> None:
        self.dataset()

    def dataset(self):
        if self._ds is None:
            self._ds = open_run(self.store, self.run, self.fetch, self.cache_dir, self.endpoint_url)
            if not self._ds.index.store_final:
                raise ReaderError(f"run {self.run!r} stores no final hidden state; speculators reads it as its last "
                                  "slot: extract with a layer spec ending in +final (e.g. --layers eagle3 or dflash:5+final)")
        return self._ds

    def gain(self, hidden_size: int) -> torch.Tensor:
        if self._gain is None:
            from hsx_tools.export import final_norm_gain

            self._gain = final_norm_gain(self.dataset().manifest.model, hidden_size)
        return self._gain

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        ds = self.dataset()
        if not 0 <= file_idx < len(ds):
            return None
        from hsx_tools.export import speculators_record

        sample = ds[file_idx]
        record = speculators_record(sample, ds.index.hidden_size, self.gain(ds.index.hidden_size))
        return {"hidden_states": record["hidden_states"], "token_ids": record["token_ids"]}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return None   # hsx extracts ahead of training; nothing is generated on demand

    def __getstate__(self):
        return {**self.__dict__, "_ds": None}


@HiddenStatesBackend.register("hsx")
class HsxBackend(HiddenStatesBackend):
    """Hidden states read in place from an hsx run (local directory or s3://bucket/prefix)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hsx-store", type=str, default=None,
                            help="hsx store holding the run: s3://bucket/prefix or a local directory")
        parser.add_argument("--hsx-run", type=str, default=None, help="hsx run name")
        parser.add_argument("--hsx-fetch", type=str, default="object", choices=["object", "range"],
                            help="object: whole batch objects, SHA-256 checked, cached; range: only each sample's bytes")
        parser.add_argument("--hsx-cache-dir", type=str, default=None,
                            help="local folder for the object cache (default: memory)")
        parser.add_argument("--hsx-s3-endpoint-url", type=str, default=None, help="S3-compatible endpoint URL")
        parser.add_argument("--hsx-mode", type=str, default="complete", choices=["complete", "follow"],
                            help="complete: a completed run, by its index; follow: the run while it is extracted, "
                                 "through its ledger (Redis from HSX_REDIS_URL), each batch as it is recorded done, "
                                 "until the run is COMPLETE")
        parser.add_argument("--hsx-follow-log", type=str, default=None,
                            help="with --hsx-mode follow: append a JSON line per step and per object read to this file")
        parser.add_argument("--hsx-on-dead-letter", type=str, default="wait", choices=["wait", "skip", "stop"],
                            help="with --hsx-mode follow, when only dead letters are left: wait (for hsx "
                                 "retry-failed), skip them (end the epoch) or stop")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """hsx extracts with its own pipeline (hsx produce/worker/upload), not through vLLM."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> HsxTransfer | FollowTransfer:
        if getattr(args, "hsx_mode", "complete") == "follow":   # callers may build args without it
            if not args.hsx_run:
                raise ValueError("--hsx-mode follow needs --hsx-run")
            store = StoreSettings(url=args.hsx_store, endpoint_url=args.hsx_s3_endpoint_url) if args.hsx_store else None
            redis_url = os.environ.get("HSX_REDIS_URL") or os.environ.get("REDIS_URL")
            if not redis_url:   # never a flag: speculators writes every flag into run.yaml
                raise ValueError("--hsx-mode follow needs HSX_REDIS_URL (or REDIS_URL) in the environment, "
                                 "e.g. redis://127.0.0.1:6379/0")
            redis_url = with_redis_password(redis_url, os.environ.get("HSX_REDIS_PASSWORD"))
            return FollowTransfer(redis_url, args.hsx_run, store, args.save_path, args.hsx_follow_log,
                                  getattr(args, "hsx_on_dead_letter", "wait"))
        if not args.hsx_store or not args.hsx_run:
            raise ValueError("--hidden-states-backend hsx needs --hsx-store and --hsx-run")
        return HsxTransfer(args.hsx_store, args.hsx_run, args.hsx_fetch, args.hsx_cache_dir, args.hsx_s3_endpoint_url)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ValueError("the hsx backend reads runs hsx extracted; it has no vLLM side")


def write_tokens(store: str, run: str, out: str, endpoint_url: str | None = None) -> int:
    """speculators' Arrow dataset of the run's token columns (torch format) at ``out``, and beside it
    ``token_freq.pt`` (as ``hsx export`` and speculators' own prepare step write it), from which
    ``--draft-vocab-size`` picks the draft vocabulary; returns its rows."""
    from datasets import Dataset

    from hsx_tools.export import write_token_freq

    ds = open_run(store, run, "range", endpoint_url=endpoint_url)
    columns = token_columns(ds)
    table = Dataset.from_dict(columns)
    table.set_format("torch")
    table.save_to_disk(out)
    write_token_freq(Path(out), columns["input_ids"], columns["loss_mask"])
    return len(table)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from speculators.train.cli import main as train
        from speculators.train.config import TrainConfig

        try:
            train(TrainConfig.resolve(argv[1:]))
        except (ReaderError, HsxError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    parser = argparse.ArgumentParser(prog="python -m hsx_peers.speculators")
    sub = parser.add_subparsers(dest="command", required=True)
    tokens = sub.add_parser("tokens", help="write speculators' token dataset of an hsx run (no hidden states)")
    tokens.add_argument("--store", required=True)
    tokens.add_argument("--run", required=True)
    tokens.add_argument("--out", required=True)
    tokens.add_argument("--s3-endpoint-url", default=None)
    sub.add_parser("train", help="speculators train, with the hsx backend registered (all flags are speculators')")
    args = parser.parse_args(argv)
    try:
        rows = write_tokens(args.store, args.run, args.out, args.s3_endpoint_url)
    except ReaderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{rows} samples' token columns -> {args.out}")
    return 0


# After HsxBackend is registered: importing speculators' cli snapshots the backend registry.
install()


if __name__ == "__main__":
    sys.exit(main())
