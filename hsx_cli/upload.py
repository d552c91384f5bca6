"""`hsx upload`: move this host's spool files to the store."""

from __future__ import annotations

from pathlib import Path

from hsx.runspec import UploadConfig
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, SPOOL_FLAGS, host, memory_spool_dir, redis_url, worker_name
from hsx_cli.flags import Flag

FLAGS = (
    *SPOOL_FLAGS,
    Flag("--verify-readback", "after each upload, read the object back (GET) and check its size and SHA-256 before "
         "recording it done; for stores whose HEAD may answer for an object that is not there (one more read of "
         "every byte)", type=bool),
    REDIS_URL,
)


def config(v) -> UploadConfig:
    return UploadConfig(redis_url=redis_url(v), spool_dir=Path(v["spool_dir"]), host=host(v), burst=v["burst"],
                        worker_name=v["name"] or worker_name("upload", host(v)), heartbeat_seconds=v["heartbeat_seconds"],
                        log_every_seconds=v["log_every_seconds"], memory_spool_dir=memory_spool_dir(v),
                        verify_readback=v["verify_readback"])


def run(cfg: UploadConfig) -> int:
    from uploader.worker import run_uploader

    rt = run_uploader(cfg)
    print(f"uploader {cfg.worker_name}: {rt.uploaded} batches uploaded, {rt.failures} failed tries")
    return 0


COMMAND = Command(
    "upload", "upload spool files of this host, verify, record done",
    "An rq worker on upload@HOST: uploads each batch file under --spool-dir (multipart when large), verifies "
    "size and checksum in the store, records the batch done in the ledger, then deletes the local file. "
    "Run several per host.",
    FLAGS, config, run)
