"""`hsx retry-failed`: re-enqueue dead-letter batches."""

from __future__ import annotations

from dataclasses import dataclass

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, redis_url
from hsx_cli.flags import Flag

FLAGS = (
    RUN,
    Flag("--batch", "only this batch id (repeatable; the variable takes a comma-separated list)", repeat=True),
    REDIS_URL,
)


@dataclass(frozen=True)
class RetryConfig:
    redis_url: str
    run: str
    batches: tuple[str, ...]     # empty: every dead letter


def config(v) -> RetryConfig:
    return RetryConfig(redis_url(v), v["run"], tuple(v["batch"] or ()))


def run(cfg: RetryConfig) -> int:
    from hsx import life
    from hsx.redisconn import connect

    ledger = life.Run(connect(cfg.redis_url), cfg.run)
    ledger.require_manifest()  # an unknown run is a mistyped name (exit 2), not "0 re-enqueued"
    taken = ledger.retry(list(cfg.batches) or None)
    print(f"re-enqueued {len(taken)} dead-letter batches of run {cfg.run}")
    return 0


COMMAND = Command(
    "retry-failed", "re-enqueue batches from the dead-letter record",
    "Take batches out of the run's dead-letter record (all, or those named with --batch), reset their failure "
    "count and put them back on the extract queue. A batch id that is not in the plan, or not a dead letter, "
    "is refused with the reason and nothing is changed.",
    FLAGS, config, run)
