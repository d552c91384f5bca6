"""`hsx verify`: check the store against the plan."""

from __future__ import annotations

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, redis_url
from hsx_cli.flags import Flag

FLAGS = (
    RUN,
    Flag("--quick", "size and checksum metadata only; do not read every object", type=bool),
    REDIS_URL,
)


def config(v):
    from hsx_tools.verify import VerifyConfig

    return VerifyConfig(redis_url(v), v["run"], v["quick"])


def run(cfg) -> int:
    from hsx_tools.verify import run_verify

    return run_verify(cfg)


COMMAND = Command(
    "verify", "check the store against the plan; non-zero exit on any gap",
    "Every planned batch present in the store with the right size and checksum, every sample id exactly once, "
    "hidden states finite. Prints a summary; exits 1 on any gap.",
    FLAGS, config, run)
