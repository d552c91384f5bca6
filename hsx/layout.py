"""Where things live: store keys and spool paths, all derived from (run, batch id)."""

from __future__ import annotations

import re
from pathlib import Path

from hsx.errors import HsxError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class RunNameError(HsxError, ValueError):
    """A run name hsx cannot use in keys and paths."""


def check_run_name(run: str) -> str:
    if not RUN_NAME.match(run):
        raise RunNameError(f"run name {run!r} must be 1-64 letters, digits, '_' or '-', starting with a letter or digit")
    return run


def batch_id(index: int) -> str:
    return f"b{index:07d}"


def shard_of(index: int, batches_per_shard: int) -> str:
    return f"{index // batches_per_shard:05d}"


def manifest_key(run: str) -> str:
    return f"{run}/manifest.json"


def index_key(run: str) -> str:
    return f"{run}/index.jsonl"


def input_key(run: str, shard: str, bid: str) -> str:
    return f"{run}/inputs/{shard}/{bid}.safetensors"


def batch_key(run: str, shard: str, bid: str) -> str:
    return f"{run}/batches/{shard}/{bid}.safetensors"


def spool_path(spool_dir: Path, run: str, bid: str) -> Path:
    """A finished batch file waiting for upload; its temp files share the name plus '.tmp-<pid>'."""
    return Path(spool_dir) / run / f"{bid}.safetensors"
