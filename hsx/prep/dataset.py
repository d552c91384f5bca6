"""Reading the input dataset: JSONL, Parquet or a `datasets` folder.

Each row is a dict of columns; hsx/prep/rows.py says which row formats are understood
(OpenAI ``messages``, ShareGPT ``conversations``, instruction columns, pre-tokenised
``input_ids`` + ``loss_mask``). The stable sample id is the ``id`` column (or the
column a ColumnMapping names) when present, else the row's 0-based index. A line that
cannot be read is reported as a RowError with its index, a stable reason code and a
message; the other rows go on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.errors import HsxError


class DatasetError(HsxError, ValueError):
    """The dataset as a whole cannot be read."""


@dataclass(frozen=True)
class Row:
    index: int          # position in the dataset, 0-based
    data: dict[str, Any]


@dataclass(frozen=True)
class RowError:
    index: int
    reason: str             # human-readable
    code: str = "unreadable"  # stable, for counting: empty_line | bad_json | not_an_object

    def __str__(self) -> str:
        return f"row {self.index}: {self.reason}"


def _json_error(line: bytes) -> str:
    """json's reason for a bad line, without the line's own ending (read as part of a string, a string cut short
    was "Invalid control character at"), and with "at" once (json's "Unterminated string starting at" + "at
    column" read "at at column")."""
    try:
        json.loads(line.rstrip(b"\r\n"))
    except json.JSONDecodeError as exc:
        return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
    return "unreadable"  # not reached: the line failed with its ending, and the ending is JSON whitespace


def _iter_jsonl(path: Path) -> Iterator[Row | RowError]:
    with open(path, "rb") as fh:
        for index, line in enumerate(fh):
            # Rows count from 0 (the sample id); the reason names the file's line counting from 1, as editors do.
            if not line.strip():
                yield RowError(index, f"line {index + 1} of {path.name} is empty", "empty_line")
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                yield RowError(index, f"line {index + 1} of {path.name} is not valid JSON: {_json_error(line)}", "bad_json")
                continue
            except ValueError as exc:  # not UTF-8
                yield RowError(index, f"line {index + 1} of {path.name} is not valid JSON: {exc}", "bad_json")
                continue
            except RecursionError:     # e.g. 100k nested '[': the decoder recurses once a level
                yield RowError(index, f"line {index + 1} of {path.name} is nested too deeply to read as JSON", "bad_json")
                continue
            if not isinstance(data, dict):
                yield RowError(index, f"expected a JSON object, got {type(data).__name__}", "not_an_object")
                continue
            yield Row(index, data)


def _iter_parquet(path: Path) -> Iterator[Row | RowError]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError("reading Parquet needs pyarrow: pip install 'hsx[parquet]'") from None
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        for data in batch.to_pylist():
            yield Row(index, data)
            index += 1


def _iter_hf_folder(path: Path) -> Iterator[Row | RowError]:
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{path} looks like a `datasets` folder; reading it needs the `datasets` package") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DatasetError(f"{path}: a DatasetDict without a 'train' split ({list(ds)})")
        ds = ds["train"]
    for index, data in enumerate(ds):
        yield Row(index, data)


def iter_rows(path: Path) -> Iterator[Row | RowError]:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.is_dir():
        return _iter_hf_folder(path)
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return _iter_jsonl(path)
    raise DatasetError(f"dataset {path}: unknown format (want .jsonl, .parquet or a `datasets` folder)")


def fingerprints(path: Path) -> tuple[str, str]:
    """(content, named): SHA-256s over the dataset's bytes (a file, or every file of a folder in name order).

    ``content`` is the run's ``dataset_fingerprint``: the same rows under another file name are the same
    dataset (a folder's files are still told apart by their paths inside it). ``named`` also covers a
    single file's name, as manifests written before this did: ``hsx produce`` accepts it for those runs.
    """
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    content, named = hashlib.sha256(), hashlib.sha256()
    for f in files:
        if path.is_dir():
            content.update(str(f.relative_to(path)).encode())
        named.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            while block := fh.read(8 * 2**20):
                content.update(block)
                named.update(block)
    return content.hexdigest(), named.hexdigest()
