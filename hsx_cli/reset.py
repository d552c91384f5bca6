"""`hsx reset`: remove a run's Redis keys and queued jobs (and, with --store, its objects) to plan it anew."""

from __future__ import annotations

import dataclasses
import sys

from hsx.errors import ConfigError
from hsx.store import StoreSettings
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, STORE_FLAGS, redis_url
from hsx_cli.flags import Flag

FLAGS = (
    Flag("--run", "the run to reset", required=True),
    Flag("--store", "also delete the run's objects in this store (s3://bucket/prefix or a local directory; "
         "must be the run's own store when Redis still records it)"),
    *STORE_FLAGS,
    Flag("--yes", "do not ask", type=bool),
    Flag("--even-if-live", "reset although the run's workers beat or batches are leased: they may write keys back "
         "into the run planned next and upload the old plan's spool files as its batches", type=bool),
    REDIS_URL,
)


@dataclasses.dataclass(frozen=True)
class ResetConfig:
    redis_url: str
    run: str
    store: StoreSettings | None
    yes: bool
    even_if_live: bool = False


def config(v) -> ResetConfig:
    from hsx.prep import resolve_store_url
    from hsx_cli.common import store_settings

    store = None
    if v["store"]:
        store = store_settings(v)
        store = dataclasses.replace(store, url=resolve_store_url(store.url))
    return ResetConfig(redis_url(v), v["run"], store, v["yes"], v["even_if_live"])


def run(cfg: ResetConfig) -> int:
    from hsx import life
    from hsx.redisconn import connect

    ledger = life.Run(connect(cfg.redis_url), cfg.run)
    manifest = ledger.manifest()
    recorded = manifest.store_url if manifest is not None else None   # absolute: Manifest resolves an old relative one
    if cfg.store is not None and recorded and recorded != cfg.store.url:
        raise ConfigError(f"--store {cfg.store.url} is not run {cfg.run}'s store ({recorded}); nothing was changed")
    store = cfg.store.open() if cfg.store is not None else None
    plan = ledger.plan_reset(store, allow_live=cfg.even_if_live)
    if not plan.redis_keys and not plan.jobs and not plan.objects:
        print(f"run {cfg.run}: nothing to reset (no Redis keys, no queued jobs"
              + (", no objects in the store)" if store is not None else ")"))
        return 0
    if not cfg.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"reset would delete {plan.summary().split(': ', 1)[1]}; pass --yes to confirm "
                              "(no terminal to ask)")
        answer = input(f"delete {plan.summary()}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing was changed")
            return 1
    ledger.apply_reset(plan, store)
    print(f"reset {plan.summary()}: removed")
    if store is None:
        print(f"store objects kept{' in ' + recorded if recorded else ''}: its {cfg.run}/manifest.json still pins the "
              "old settings; reset again with --store STORE to delete them")
    return 0


COMMAND = Command(
    "reset", "start a run over: delete its Redis keys and queued jobs (and its store objects with --store)",
    "Remove everything Redis holds for the run (manifest, plan, ledger, counters, leases, heartbeats) and its jobs "
    "on the extract and upload queues; with --store also every object under <store>/<run>/. Asks first (or --yes). "
    "Refused while a producer works on the run, and while its workers beat or batches are leased (--even-if-live "
    "overrides that, at a risk it names). Then `hsx produce` plans the run anew, with any settings.",
    FLAGS, config, run)
