"""`hsx export`: a finished run in the per-sample layout a drafter trainer reads."""

from __future__ import annotations

from pathlib import Path

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, STORE_FLAGS, store_settings
from hsx_cli.flags import Flag

FLAGS = (
    RUN,
    Flag("--for", "the trainer and algorithm the files are for (key names and layout follow it)",
         choices=("specforge-eagle3", "specforge-dflash", "specforge-dspark", "speculators-eagle3", "speculators-dflash")),
    Flag("--format", "older spelling: specforge (eagle3 keys if the run stored the final state, else dflash) or "
         "speculators (= speculators-eagle3)", choices=("specforge", "speculators")),
    Flag("--out", "output directory", required=True),
    Flag("--limit", "export at most this many samples", type=int, min=1),
    Flag("--shard", "only this store shard, e.g. 00003 (repeatable)", repeat=True),
    Flag("--store", "s3://bucket/prefix or a local directory (default: the store the run recorded in Redis)"),
    *STORE_FLAGS,
    REDIS_URL,
)


def config(v):
    from hsx.errors import ConfigError
    from hsx_tools.export import ExportConfig

    if bool(v["for"]) == bool(v["format"]):
        raise ConfigError("say which trainer the export is for: --for specforge-eagle3|specforge-dflash|"
                          "specforge-dspark|speculators-eagle3|speculators-dflash")
    return ExportConfig(run=v["run"], format=v["for"] or v["format"], out=Path(v["out"]),
                        store=store_settings(v) if v["store"] else None, redis_url=v["redis_url"],
                        limit=v["limit"], shards=tuple(v["shard"] or ()))


def run(cfg) -> int:
    from hsx_tools.export import run_export

    return run_export(cfg)


COMMAND = Command(
    "export", "write a finished run in the per-sample layout a drafter trainer reads",
    "Export each sample of a completed run as SpecForge (data_<i>.ckpt under rows_*/) or vLLM speculators "
    "(hs_<i>.safetensors + dataset/ + token_freq.pt) files, with the key names the --for trainer reads; a run "
    "that lacks a layer the trainer needs is refused. Resumable: existing files are skipped.",
    FLAGS, config, run)
