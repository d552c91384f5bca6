"""Role configuration: one frozen object per role, from CLI flags with HSX_* fallbacks.

Flags and their HSX_* variables are read in one place, hsx_cli/flags.py, never
here and never at import time; these objects only carry the resolved values.
Secrets (AWS credentials, a Redis password) are never flags: boto3 reads its
own chain, and a Redis password goes in HSX_REDIS_URL / REDIS_URL or HSX_REDIS_PASSWORD only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from hsx import defaults as D
from hsx.errors import ConfigError
from hsx.store import StoreSettings

__all__ = ["ConfigError", "StoreSettings", "ProduceConfig", "WorkerConfig", "UploadConfig", "with_redis_password"]


def with_redis_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` (URL-quoted: any characters) when it carries none: one HSX_REDIS_PASSWORD
    in .env serves Redis's healthcheck (docker-compose.yml) and every role."""
    parts = urlsplit(url)
    if not password or parts.password is not None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{quote(password, safe='')}@{host}"))


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
    tokenise_workers: int                   # processes tokenising; 0 = every core
    enqueue: bool = True
    max_attempts: int = D.DEFAULT_MAX_ATTEMPTS      # run limit (manifest): failures of a batch before dead letters
    lease_seconds: int = D.DEFAULT_LEASE_SECONDS    # run limit (manifest): lease life without a refresh
    template_kwargs: dict | None = None     # chat-template arguments, e.g. {"enable_thinking": true}; in the manifest
    columns: object = None                  # hsx.prep.columns.ColumnMapping: instruction columns -> turns; in the manifest
    mixture: object = None                  # hsx.prep.Mixture: several sources (dataset: the mixture file or the first); in the manifest
    window_rows: int = D.DEFAULT_WINDOW_ROWS      # dataset rows planned (sorted + cut) together; in the manifest
    max_reject_share: float = D.DEFAULT_MAX_REJECT_SHARE  # fail, nothing enqueued, when more rows than this share are rejected
    lock_wait_seconds: float = 0.0          # wait this long for another producer of the run, then refuse
    store_dtype: str | None = None   # what batch files hold: None = dtype, or float8_e4m3 (hsx/batch/dtypes.py)
    codec: str = "none"              # lossless codec of the hidden states: none | zstd (hsx/batch/codec.py)
    compute_dtype: str = "bfloat16"  # the target's linear layers: bfloat16 | float8 (gpu_worker/fp8compute.py)
    fp8_accumulation: str = D.DEFAULT_FP8_ACCUMULATION  # float8 GEMMs: fp32 | fast (gpu_worker/fp8linear.py)
    per_turn: bool = False           # one sample a turn of each row (hsx/prep/perturn.py); in the manifest
    prefix_reuse: str = "auto"       # auto: shared prefixes computed once where exact (hsx/prep/prefixplan.py) | off
    prefix_min_tokens: int = D.DEFAULT_PREFIX_MIN_TOKENS   # tokens a spine has at least
    prefix_forward_tokens: int = D.DEFAULT_PREFIX_FORWARD_TOKENS   # the price of a forward in tokens (planning)
    prefix_stored_budgets: int = D.AUTO_PREFIX_STORED_BUDGETS   # token budgets a batch of trees may store (0: auto)
    prefix_rows: str = D.PREFIX_ROWS[0]   # packed | padded: how the workers run a tree batch's rows (planning)


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
    heartbeat_seconds: float
    grace_seconds: float = 120.0   # on SIGTERM: time to finish writing before handing batches back
    wait_for_plan: bool = False     # wait for `hsx produce` instead of exiting when the run is not planned
    exit_when_complete: bool = False  # exit 0 once the run is complete (batch schedulers: SLURM array tasks)
    log_every_seconds: float = D.DEFAULT_LOG_EVERY_SECONDS  # progress line at least this often (and every N batches)
    memory_spool_dir: Path | None = None  # the memory tier (tmpfs); None: disk tier only
    memory_spool_budget_bytes: int = 0
    memory_spool_why: str = ""  # how the memory tier's budget was chosen (hsx worker's start line says it)
    kernels: str = D.DEFAULT_KERNELS  # auto: fused kernels + packed rows where available (gpu_worker/kernels.py) | padded | eager
    # tokens a forward costs this worker where it runs tree batches group by group (no packed waves): a tree batch
    # runs its samples alone where that costs less (gpu_worker/prefixrun.py ``cheaper_alone``); 0: trees as planned
    prefix_forward_tokens: int = D.GROUPWISE_PREFIX_FORWARD_TOKENS

    @property
    def tiers(self):
        """The spool tiers this worker writes to, memory first (spool_dir / spool_budget_bytes: the disk tier)."""
        from hsx.runspec.spool import SpoolTiers

        return SpoolTiers.of(self.spool_dir, self.spool_budget_bytes, self.memory_spool_dir,
                             self.memory_spool_budget_bytes)


@dataclass(frozen=True)
class UploadConfig:
    """Run limits (attempts, lease length) are not here: each run's manifest holds them."""

    redis_url: str
    spool_dir: Path          # uploads only files under this directory
    host: str                # serves the queue upload@<host>
    burst: bool
    worker_name: str
    heartbeat_seconds: float = D.DEFAULT_HEARTBEAT_SECONDS
    log_every_seconds: float = D.DEFAULT_LOG_EVERY_SECONDS
    memory_spool_dir: Path | None = None  # the host's memory tier, where workers write first
    verify_readback: bool = False  # GET each object after upload and check size + SHA-256 (stores whose HEAD lies)

    @property
    def tiers(self):
        """Where upload jobs' files may be: both tiers (budgets are the workers' business)."""
        from hsx.runspec.spool import SpoolTiers

        return SpoolTiers.of(self.spool_dir, 1, self.memory_spool_dir, 1 if self.memory_spool_dir else 0)
