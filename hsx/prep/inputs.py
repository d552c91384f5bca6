"""A run's settings and inputs, checked and resolved once, before anything is written.

`hsx produce` and `hsx inspect` share these checks (same message, exit 2). Every path a
manifest holds is made absolute here (docs/architecture.md, rule 8): a relative ``--store relstore``
means the same folder to a worker or uploader started from any other directory.
URLs (s3://, file://) and hub ids stay as written.
"""

from __future__ import annotations

from pathlib import Path

from hsx.errors import HsxError
from hsx.prep.dataset import DatasetError


def round_up(n: int, multiple: int) -> int:  # as hsx.prep.planning's, without importing numpy: checks come first
    return -(-n // multiple) * multiple


class SettingsError(HsxError, ValueError):
    """Flags that cannot make a run together; the message names them and the fix."""


def check_budget(max_length: int, token_budget: int, pad_multiple: int) -> None:
    """Every kept sample (at most ``max_length`` tokens, padded up to ``pad_multiple``) must fit one batch."""
    longest = round_up(max_length, pad_multiple)
    if longest > token_budget:
        raise SettingsError(
            f"--max-length {max_length}"
            + (f" (padded to {longest} by --pad-multiple {pad_multiple})" if longest != max_length else "")
            + f" exceeds --token-budget "
            f"{token_budget}: a sample that long would fit no batch; raise --token-budget to at least {longest} or "
            f"lower --max-length to {token_budget - token_budget % pad_multiple or pad_multiple}")


def check_row_settings(overlong: str, max_reject_share: float) -> None:
    if overlong not in ("drop", "truncate"):
        raise SettingsError(f"--overlong must be drop or truncate, got {overlong!r}")
    if not 0.0 <= max_reject_share <= 1.0:
        raise SettingsError(f"--max-reject-share must be a share between 0 and 1, got {max_reject_share}")


def resolve_dataset(dataset: Path | str) -> Path:
    """The dataset as an absolute path; DatasetError when it is not there."""
    path = Path(dataset).expanduser()
    if not path.exists():
        raise DatasetError(f"dataset {dataset} does not exist (--dataset / HSX_DATASET)")
    return path.resolve()


def resolve_model(model: str) -> str:
    """A local model folder as an absolute path; a hub id (or URL) as written."""
    if "://" in model:
        return model
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def resolve_store_url(url: str) -> str:
    """A local store folder as an absolute path (file:// kept as file://); S3 URLs as written."""
    if url.startswith("file://"):
        return "file://" + str(Path(url.removeprefix("file://")).expanduser().resolve())
    if "://" in url:
        return url
    return str(Path(url).expanduser().resolve())
