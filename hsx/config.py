"""Role configuration: one frozen object per role, from CLI flags with HSX_* fallbacks.

Environment variables are read when a config is built, never at import time.
Secrets (AWS credentials, a Redis password) are never flags: boto3 reads its
own chain, and a Redis password goes in HSX_REDIS_URL / REDIS_URL only.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from hsx.redisconn import redact


class ConfigError(ValueError):
    """A setting is missing or wrong; the message names it."""


def env(name: str, default: str | None = None) -> str | None:
    """``HSX_<name>`` from the environment, else ``default``."""
    return os.environ.get(f"HSX_{name}", default)


def redis_url_from(flag: str | None) -> str | None:
    if flag and redact(flag) != flag:
        raise ConfigError("--redis-url must not carry a password (it would show in the process list); "
                          "set HSX_REDIS_URL or REDIS_URL in the environment instead")
    return flag or os.environ.get("HSX_REDIS_URL") or os.environ.get("REDIS_URL")


def hostname() -> str:
    return env("HOST") or socket.gethostname()


@dataclass(frozen=True)
class StoreSettings:
    """Where outputs land. ``url``: s3://bucket/prefix or a local directory. No credentials here."""

    url: str
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"
    verify_etag: bool = True

    @classmethod
    def resolve(cls, url: str | None, endpoint_url: str | None = None, region: str | None = None,
                addressing_style: str | None = None, recorded: dict | None = None) -> "StoreSettings":
        """Flags, then HSX_* env, then what the run recorded (``recorded``), then defaults."""
        recorded = recorded or {}
        url = url or env("STORE") or recorded.get("url")
        if not url:
            raise ConfigError("no store: pass --store s3://bucket/prefix (or a local directory), or set HSX_STORE")
        style = addressing_style or env("S3_ADDRESSING_STYLE") or recorded.get("addressing_style") or "auto"
        if style not in ("auto", "path", "virtual"):
            raise ConfigError(f"S3 addressing style must be auto, path or virtual, got {style!r}")
        return cls(
            url=url,
            endpoint_url=endpoint_url or env("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or recorded.get("endpoint_url"),
            region=region or env("S3_REGION") or os.environ.get("AWS_REGION") or recorded.get("region"),
            addressing_style=style,
            verify_etag=(env("S3_VERIFY_ETAG") or str(recorded.get("verify_etag", "1"))).lower() not in ("0", "false", "no"),
        )

    def open(self):
        from hsx.store import open_store

        return open_store(self.url, self.endpoint_url, self.region, self.addressing_style, self.verify_etag)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ProduceConfig:
    run: str
    dataset: Path
    model: str
    layers: str
    store: StoreSettings
    redis_url: str
    token_budget: int
    max_length: int
    overlong: str            # drop | truncate
    max_batch_rows: int
    pad_multiple: int
    dtype: str
    batches_per_shard: int
    tokenise_workers: int
    enqueue: bool = True


@dataclass(frozen=True)
class WorkerConfig:
    run: str
    redis_url: str
    device: str              # cpu | cuda:N
    spool_dir: Path
    spool_budget_bytes: int
    host: str
    model_override: str | None
    burst: bool
    worker_name: str
    max_attempts: int
    lease_seconds: int
    heartbeat_seconds: float
    grace_seconds: float = 120.0   # on SIGTERM: time to finish writing before handing batches back
    min_batch_seconds: float = 0.0  # stretch each batch to this wall time (fault-injection tests only)
    wait_for_plan: bool = False     # wait for `hsx produce` instead of exiting when the run is not planned


@dataclass(frozen=True)
class UploadConfig:
    redis_url: str
    spool_dir: Path
    host: str
    burst: bool
    worker_name: str
    max_attempts: int
    lease_seconds: int = 60        # an upload whose uploader died is re-enqueued this long after its last refresh
    heartbeat_seconds: float = 5.0
