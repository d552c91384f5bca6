"""`hsx show RUN [SAMPLE]`: a stored sample, read back and checked."""

from __future__ import annotations

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, STORE_FLAGS, store_settings
from hsx_cli.flags import Flag

FLAGS = (
    Flag("run", "run name", required=True),
    Flag("sample", "a sample id, or #N for line N of the run's index (none: the run and its first sample ids)",
         env="HSX_SHOW_SAMPLE"),
    Flag("--store", "s3://bucket/prefix or a local directory (default: the store the run recorded in Redis)"),
    *STORE_FLAGS,
    Flag("--chars", "characters of the text shown (plain output)", type=int, default=4000, min=1),
    Flag("--plain", "plain [[...]] markers even in a terminal", type=bool),
    REDIS_URL,
)


def config(v):
    from hsx_tools.show import ShowConfig

    return ShowConfig(run=v["run"], sample=v["sample"], store=store_settings(v) if v["store"] else None,
                      redis_url=v["redis_url"], chars=v["chars"], plain=v["plain"])


def run(cfg) -> int:
    from hsx_tools.show import run_show

    return run_show(cfg)


COMMAND = Command(
    "show", "a stored sample: its text with the loss mask marked, shapes, per-layer statistics, bytes",
    "Read a run's sample back through hsx_reader (the object checked against the size and SHA-256 the run's index "
    "recorded) and print its text with the loss-masked tokens marked ([[...]] when piped), every tensor's shape "
    "and dtype, per stored layer the hidden states' mean, std, max |x| and non-finite count, and its bytes. "
    "Without SAMPLE: the run and its first sample ids. Needs the store, not Redis (--store).",
    FLAGS, config, run)
