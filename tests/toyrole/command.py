"""`hsx tally`: what would be hsx_cli/tally.py; hsx_cli.main.COMMANDS lists it (the one line)."""

from __future__ import annotations

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, SPOOL_FLAGS, host, redis_url, worker_name
from tests.toyrole.runtime import TallyConfig

FLAGS = (RUN, *(f for f in SPOOL_FLAGS if f.name in ("--host", "--name", "--burst", "--heartbeat-seconds",
                                                    "--log-every-seconds")), REDIS_URL)


def config(v) -> TallyConfig:
    return TallyConfig(v["run"], redis_url(v), host(v), v["name"] or worker_name("tally", host(v)), v["burst"],
                       v["heartbeat_seconds"], v["log_every_seconds"])


def run(cfg: TallyConfig) -> int:
    from hsx.redisconn import connect
    from tests.toyrole.runtime import TallyRuntime

    rt = TallyRuntime(cfg, connect(cfg.redis_url))
    rt.serve()
    print(f"tally {cfg.worker_name}: {rt.added} numbers, sum {rt.sum}")
    return 0


COMMAND = Command("tally", "add numbers (a toy role)", "An rq worker on tally:RUN; each job adds one number.",
                  FLAGS, config, run)
