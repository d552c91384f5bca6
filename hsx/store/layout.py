"""Where things live: store keys and spool paths, all derived from (run, batch id).

Run names, shards and batch ids reach these functions from Redis (plan specs, job
kwargs), which hsx does not trust (docs/architecture.md, rule 5): each must be one plain path
segment (``NAME``), so a forged ``../other-run`` cannot steer a read, a write or a
delete to another run's object or file.
"""

from __future__ import annotations

import re
from pathlib import Path

from hsx.errors import HsxError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
NAME = RUN_NAME  # a shard or batch id: the same alphabet, so never '/', '..' or empty


def segment(value: str, what: str) -> str:
    """``value`` if it is a plain path segment (NAME), else ValueError naming ``what``."""
    if not isinstance(value, str) or not NAME.match(value):
        raise ValueError(f"{what} {value!r} is not a plain name (1-64 letters, digits, '_' or '-'); "
                         "it came from Redis and is not used in a key or path")
    return value


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


def store_error_key(run: str) -> str:
    """The run-level record of a lossy store dtype's measured error (hsx/life/storeerror.py)."""
    return f"{run}/store_error.json"


def compute_error_key(run: str) -> str:
    """The run-level record of FP8 compute's measured error (hsx/life/computeerror.py)."""
    return f"{run}/compute_error.json"


def evaluation_key(run: str) -> str:
    """The last `hsx evaluate` of a drafter trained on the run (hsx/monitor/evaluation.py)."""
    return f"{run}/evaluation.json"


def window_ids_key(run: str, number: int) -> str:
    """The sample ids of a planned window's batches (hsx/life/planids.py): the plan in Redis keeps their digest."""
    return f"{segment(run, 'run')}/plan/window-{int(number):06d}.json"


def _names(run: str, shard: str, bid: str) -> tuple[str, str, str]:
    return segment(run, "run"), segment(shard, "shard"), segment(bid, "batch id")


def input_key(run: str, shard: str, bid: str) -> str:
    run, shard, bid = _names(run, shard, bid)
    return f"{run}/inputs/{shard}/{bid}.safetensors"


def batch_key(run: str, shard: str, bid: str) -> str:
    run, shard, bid = _names(run, shard, bid)
    return f"{run}/batches/{shard}/{bid}.safetensors"


def spool_path(spool_dir: Path, run: str, bid: str) -> Path:
    """A finished batch file waiting for upload; its temp files share the name plus '.tmp-<tag>' (hsx/runspec/spool.py temp_tag)."""
    return Path(spool_dir) / segment(run, "run") / f"{segment(bid, 'batch id')}.safetensors"
