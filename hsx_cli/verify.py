"""`hsx verify`: check the store against the plan."""

from __future__ import annotations

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, RUN, redis_url
from hsx_cli.flags import Flag

FLAGS = (
    RUN,
    Flag("--quick", "sizes only; do not read every object (same-size corruption needs the full check)", type=bool),
    Flag("--repair", "re-extract every batch found bad (out of the ledger, bad object deleted, re-enqueued at the "
         "front), re-enqueue batches in no queue, remove temp files of killed writers from a local store (a "
         "writer of this host that no longer runs: at once; any: older than 10 min), and abort multipart uploads "
         "of killed uploaders in S3", type=bool),
    Flag("--rebuild-ledger", "first record done every planned batch whose object is in the store and checks out in "
         "full (after Redis lost the run, `hsx produce` restores the plan and does the same with a lighter check)",
         type=bool),
    REDIS_URL,
)


def config(v):
    from hsx_tools.verify import VerifyConfig

    return VerifyConfig(redis_url(v), v["run"], v["quick"], v["repair"], v["rebuild_ledger"])


def run(cfg) -> int:
    from hsx_tools.verify import run_verify

    return run_verify(cfg)


COMMAND = Command(
    "verify", "check the store against the plan; non-zero exit on any gap",
    "Every planned batch present in the store with the right size and checksum, every sample id exactly once, "
    "hidden states finite, no temp files of killed writers in a local store, no incomplete multipart uploads of "
    "killed uploaders in S3 (older than the lease, no live lease). Prints a summary; exits 1 on any gap. "
    "--repair re-extracts what it finds bad.",
    FLAGS, config, run)
