"""Flags and helpers several sub-commands share."""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path

from hsx import defaults as D
from hsx.errors import ConfigError
from hsx.redisconn import redact
from hsx.runspec import with_redis_password
from hsx.store import StoreSettings
from hsx_cli.flags import Flag, parse_bool


def _no_password_in_argv(url: str, from_argv: bool) -> None:
    if from_argv and redact(url) != url:
        raise ConfigError("--redis-url must not carry a password (it would show in the process list); "
                          "set HSX_REDIS_URL or REDIS_URL in the environment instead")


def _worker_name_ok(name: str, from_argv: bool) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", name):
        raise ConfigError(f"--name {name!r}: use letters, digits, '.', '_', ':' or '-' (it names spool temp files)")


REDIS_URL = Flag("--redis-url", "Redis URL; a password goes in the variable only, never on the command line",
                 aliases=("REDIS_URL",), validate=_no_password_in_argv)
RUN = Flag("--run", "run name", default="default")

STORE_FLAGS = (
    Flag("--s3-endpoint-url", "any S3-compatible endpoint, e.g. http://minio:9000", aliases=("AWS_ENDPOINT_URL",)),
    Flag("--s3-region", "S3 region", aliases=("AWS_REGION",)),
    Flag("--s3-addressing-style", "S3 addressing", choices=("auto", "path", "virtual")),
    Flag("--s3-verify-etag", "compare S3 ETags with the local MD5 on upload (no: the ETag is no MD5, e.g. SSE-KMS; "
         "multipart objects are then read back)", type=parse_bool, metavar="yes|no"),
    Flag("--s3-checksums", "boto3's request checksums and response validation: when_required (hsx's Content-MD5 "
         "only) or when_supported (boto3's default CRC32 / aws-chunked bodies, which some S3-compatible servers "
         "reject)", choices=("when_required", "when_supported")),
    Flag("--s3-multipart-etag", "how the endpoint forms a multipart object's ETag, which decides hsx's check of it: "
         "auto (probed once at start), composite (AWS), md5 (whole-object MD5, e.g. rclone) or readback (read every "
         "multipart object back)", choices=("auto", "composite", "md5", "readback")),
    Flag("--s3-integrity", "the checksum the server verifies on each upload: auto (crc32 where a start probe sees "
         "the server refuse a wrong x-amz-checksum-crc32 as a checksum mismatch, else md5), md5 (Content-MD5 and ETag "
         "checks) or crc32 (x-amz-checksum-crc32 and the stored ChecksumCRC32 checked; no MD5: less uploader CPU; "
         "refused at the uploader's start where the probe does not show the server checking it)",
         choices=("auto", "md5", "crc32")),
)

SPOOL_FLAGS = (
    Flag("--spool-dir", "local spool directory of this host (the spool's disk tier)", default=D.DEFAULT_SPOOL_DIR),
    Flag("--memory-spool-dir", "the spool's memory tier, a tmpfs folder shared by the roles of this host (workers "
         "write there first while their memory tier budget is above 0); default /dev/shm/hsx-<uid>-<tag of the Redis "
         "server>, one a user and Redis, so no two installs share it"),
    Flag("--host", "host name of the upload queue upload@HOST; all roles of a host share it (default: this "
         "machine's name)"),
    Flag("--name", "rq worker name, unique per process (default: role-host-pid-random)", validate=_worker_name_ok),
    Flag("--burst", "drain the queue, then exit", type=bool),
    Flag("--heartbeat-seconds", "seconds between heartbeats / lease refreshes (under half the run's lease)",
         type=float, default=D.DEFAULT_HEARTBEAT_SECONDS, above=0, max=3600),
    Flag("--log-every-seconds", f"log a progress line at least this often (and every {D.DEFAULT_LOG_EVERY_BATCHES} "
         "batches), and a summary on exit", type=float, default=D.DEFAULT_LOG_EVERY_SECONDS, above=0),
)


def redis_url(values) -> str:
    """The Redis URL, with HSX_REDIS_PASSWORD (a secret: environment only, never a flag) added when set."""
    url = values["redis_url"]
    if not url:
        raise ConfigError("no Redis: set HSX_REDIS_URL (or REDIS_URL), e.g. redis://127.0.0.1:6379/0")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix"):
        where = url.split("://")[-1].rsplit("@", 1)[-1]  # never the userinfo: it may hold a password
        raise ConfigError(f"Redis URL {where!r} needs a scheme: redis://, rediss:// (TLS) or unix://, "
                          f"e.g. redis://{where or '127.0.0.1:6379'}")
    return with_redis_password(url, os.environ.get("HSX_REDIS_PASSWORD"))


def memory_spool_dir(values) -> Path:
    """--memory-spool-dir, else this user's folder for this Redis (hsx.runspec.spool.default_memory_dir)."""
    from hsx.runspec import default_memory_dir

    return Path(values["memory_spool_dir"]) if values["memory_spool_dir"] else default_memory_dir(redis_url(values))


def store_settings(values, recorded: dict | None = None) -> StoreSettings:
    """``--store`` and the ``--s3-*`` flags (``recorded``: the run's own settings, under the flags)."""
    return StoreSettings.resolve(values.get("store"), values["s3_endpoint_url"], values["s3_region"],
                                 values["s3_addressing_style"], values["s3_verify_etag"], recorded=recorded,
                                 checksums=values["s3_checksums"], multipart_etag=values["s3_multipart_etag"],
                                 integrity=values["s3_integrity"])


def worker_name(role: str, host_name: str, extra: str = "") -> str:
    """Unique even across containers, where every process may be pid 1 under the same HSX_HOST."""
    return f"{role}-{host_name}-{extra + '-' if extra else ''}{os.getpid()}-{secrets.token_hex(3)}"


def host(values) -> str:
    return values["host"] or socket.gethostname()
