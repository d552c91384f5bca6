"""`hsx status`: progress of a run from the ledger."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, redis_url
from hsx_cli.flags import Flag

if TYPE_CHECKING:
    from hsx import life

FLAGS = (
    Flag("--run", "run (default: every run in this Redis)"),
    Flag("--json", "machine-readable output", type=bool),
    Flag("--watch", "live progress bars in the terminal", type=bool),
    Flag("--interval", "seconds between --watch refreshes", type=float, default=2.0, above=0, max=3600),
    REDIS_URL,
)


@dataclass(frozen=True)
class StatusConfig:
    redis_url: str
    run: str | None
    json: bool
    watch: bool
    interval: float


def config(v) -> StatusConfig:
    return StatusConfig(redis_url(v), v["run"], v["json"], v["watch"], v["interval"])


def run(cfg: StatusConfig) -> int:
    from hsx import life
    from hsx.monitor import run_progress, source_progress, summary_lines, with_source_lines
    from hsx.printable import printable
    from hsx.redisconn import connect

    r = connect(cfg.redis_url)
    runs = [cfg.run] if cfg.run else life.Run.names(r)
    if not runs:
        print("no runs in this Redis")
        return 1
    if cfg.run:
        _require(life.Run(r, cfg.run))
    if cfg.watch:
        import sys

        from hsx_tools.watch import watch, watch_plain

        # Live bars only on a terminal; a log file or pipe gets one summary per interval.
        return (watch if sys.stdout.isatty() else watch_plain)(r, runs[0], cfg.interval)
    reports = [{**run_progress(r, run), "sources": source_progress(r, run)} for run in runs]  # sources: a mixture's
    if cfg.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2, default=str))
    else:
        for p in reports:
            lines = with_source_lines(summary_lines(p), p["sources"])
            print("\n".join(printable(line) for line in lines))   # Redis' records: shown, never obeyed
    return 0


def _require(ledger: life.Run) -> None:
    """RunVanished where this Redis does not hold the run (exit 2, as everywhere); present is enough: run_progress
    reads it warily."""
    if not ledger.exists():
        ledger.require_manifest()


COMMAND = Command(
    "status", "progress of a run from the ledger",
    "Batches, samples and tokens done against the plan, rate and ETA, workers and their heartbeats, hosts and "
    "their spool and upload queue, dead letters. One run with --run, else every run this Redis knows. "
    "Exits 1 when Redis holds no run, 2 when it does not hold the --run named.",
    FLAGS, config, run)
