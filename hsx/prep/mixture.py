"""A mixture: several datasets (sources) planned as one run, each with its own columns, template arguments and
share of rows.

Given as ``--dataset`` repeated (sources named by their file names, the run's --columns and --template-kwargs for
all) or as a mixture file (``--mixture mix.json``, or ``mix.yaml``: the same in YAML), one JSON object::

    {"sources": [
      {"name": "orca", "dataset": "orca.parquet", "rows": 100000, "seed": 1},
      {"name": "glaive", "dataset": "glaive.jsonl", "share": 0.5, "template_kwargs": {"enable_thinking": false}},
      {"name": "alpaca", "dataset": "alpaca", "columns": "user=instruction+input,assistant=output"}
    ]}

Per source: ``name`` (letters, digits, ``_ . -``; default: the file's name without its suffix), ``dataset`` (JSONL,
Parquet or a `datasets` folder; relative to the mixture file's folder), ``columns`` (``--columns`` text or an
object), ``template_kwargs`` (merged over the run's), and at most one of ``rows`` (a cap) and ``share`` (0-1 of
its rows): that many of its rows drawn at random by ``seed`` (default 0), kept in file order.

Sample ids are namespaced by source: ``<name>/<id>`` (the row's id column, else its 0-based position in its
source), so two sources never collide. Rows are read source after source, each source starting a new window
(its first row's window index is a multiple of the window size), so every window, and so every batch, holds one
source's samples: a source's batches are a contiguous range of batch ids.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hsx.errors import HsxError
from hsx.prep.columns import ColumnMapping, ColumnMappingError
from hsx.prep.dataset import DatasetError, Row, RowError, fingerprints, iter_rows

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
KEYS = ("name", "dataset", "columns", "template_kwargs", "rows", "share", "seed")


class MixtureError(HsxError, ValueError):
    """The mixture file or the sources given cannot make a run; the message names the source and the fix."""


@dataclass(frozen=True)
class Source:
    name: str                             # the namespace of its sample ids: "<name>/<id>"
    path: Path                            # JSONL, Parquet or a `datasets` folder
    columns: ColumnMapping | None = None  # None: the run's --columns
    template_kwargs: dict | None = None   # merged over the run's --template-kwargs
    rows: int | None = None               # at most this many of its rows (drawn by seed)
    share: float | None = None            # this share of its rows (drawn by seed)
    seed: int = 0

    def record(self, fingerprint: str) -> dict[str, Any]:
        """What the manifest keeps of it (its identity: another value is another run)."""
        out: dict[str, Any] = {"name": self.name, "dataset": str(self.path), "fingerprint": fingerprint}
        if self.columns is not None:
            out["columns"] = self.columns.to_dict()
        if self.template_kwargs:
            out["template_kwargs"] = dict(self.template_kwargs)
        if self.rows is not None or self.share is not None:
            out.update({k: v for k, v in (("rows", self.rows), ("share", self.share)) if v is not None}, seed=self.seed)
        return out


class MixedRow(NamedTuple):
    """A row of a mixture: ``index`` is its place in the mixture (windows are cut by it), ``item`` the row as its
    source gives it (its own ``index``: the position in the source)."""

    index: int
    source: str
    item: Row | RowError


@dataclass(frozen=True)
class Mixture:
    sources: tuple[Source, ...]
    file: Path | None = None   # the mixture file, when given as one

    @property
    def dataset(self) -> Path:
        """What the manifest's ``dataset`` names: the mixture file, else the first source."""
        return self.file if self.file is not None else self.sources[0].path

    def resolved(self) -> Mixture:
        """Every path absolute (docs/architecture.md, rule 8); DatasetError naming a source that is not there."""
        out = []
        for s in self.sources:
            if not s.path.exists():
                raise DatasetError(f"source {s.name}: dataset {s.path} does not exist")
            out.append(Source(s.name, s.path.resolve(), s.columns, s.template_kwargs, s.rows, s.share, s.seed))
        return Mixture(tuple(out), self.file.resolve() if self.file is not None else None)

    def records(self) -> list[dict[str, Any]]:
        """The manifest's ``mixture``: each source with its content fingerprint (hsx.prep.fingerprints)."""
        return [s.record(fingerprints(s.path)[0]) for s in self.sources]

    def iter_rows(self, window_rows: int) -> Iterator[MixedRow]:
        """Every source's chosen rows, source after source; each source starts a new window."""
        start = 0
        for source in self.sources:
            chosen = _chosen(source)
            end = start
            for item in iter_rows(source.path):
                if chosen is not None and item.index not in chosen:
                    continue
                yield MixedRow(end, source.name, item)
                end += 1
            start = -(-end // window_rows) * window_rows if end > start else start


def _chosen(source: Source) -> set[int] | None:
    """The row positions a cap or share keeps (None: every row)."""
    if source.rows is None and source.share is None:
        return None
    total = count_rows(source.path)
    keep = min(source.rows, total) if source.rows is not None else round(source.share * total)
    return set(random.Random(source.seed).sample(range(total), keep))


def count_rows(path: Path) -> int:
    """Rows of a dataset: lines of a JSONL file (empty ones too: they are rows, rejected), a Parquet file's
    metadata, a `datasets` folder's length."""
    if path.suffix == ".parquet" and not path.is_dir():
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.is_dir():
        return sum(1 for _ in iter_rows(path))
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


def _int(where: str, key: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise MixtureError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
    return value


def source_from(spec: Any, where: str, base: Path) -> Source:
    """A source from its entry in a mixture file (``base``: the file's folder)."""
    if not isinstance(spec, dict):
        raise MixtureError(f"{where}: want an object with at least \"dataset\", got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise MixtureError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    if not isinstance(spec.get("dataset"), str) or not spec["dataset"]:
        raise MixtureError(f"{where}: \"dataset\" must name a JSONL, Parquet file or `datasets` folder")
    path = Path(spec["dataset"]).expanduser()
    path = path if path.is_absolute() else base / path
    name = spec.get("name", default_name(path))
    columns = spec.get("columns")
    try:
        mapping = (ColumnMapping.parse(columns) if isinstance(columns, str) else
                   ColumnMapping.from_dict(columns, where=f"{where} columns") if isinstance(columns, dict) else None)
    except ColumnMappingError as exc:
        raise MixtureError(f"{where}: {exc}") from None
    if columns is not None and mapping is None:
        raise MixtureError(f"{where}: columns must be --columns text or an object, got {type(columns).__name__}")
    kwargs = spec.get("template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise MixtureError(f"{where}: template_kwargs must be an object, got {type(kwargs).__name__}")
    rows, share = spec.get("rows"), spec.get("share")
    if rows is not None and share is not None:
        raise MixtureError(f"{where}: give rows (a cap) or share (of its rows), not both")
    if share is not None and (not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1):
        raise MixtureError(f"{where}: share must be a number in (0, 1], got {share!r}")
    return Source(name, path, mapping, kwargs, _int(where, "rows", rows, 1) if rows is not None else None,
                  float(share) if share is not None else None, _int(where, "seed", spec.get("seed", 0), 0))


def default_name(path: Path) -> str:
    """A source's name from its path: the file name without its suffix, unsafe characters as '_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path.name.split(".")[0] or path.name)[:64] or "source"


def of_sources(sources: list[Source], file: Path | None = None) -> Mixture:
    """The mixture, its names checked: safe, distinct."""
    if not sources:
        raise MixtureError(f"mixture {file or ''}: no sources".replace("  ", " "))
    seen: set[str] = set()
    for s in sources:
        if not isinstance(s.name, str) or not NAME.match(s.name):
            raise MixtureError(f"source name {s.name!r}: use 1-64 letters, digits, '_', '.' or '-' (it prefixes "
                               "the sample ids)")
        if s.name in seen:
            raise MixtureError(f"two sources are named {s.name!r}: name them apart (a mixture file's \"name\")")
        seen.add(s.name)
    return Mixture(tuple(sources), file)


def mixture_of_datasets(paths: list[str | Path]) -> Mixture:
    """``--dataset`` given several times: one source a path, named by its file name."""
    return of_sources([Source(default_name(Path(p)), Path(p).expanduser()) for p in paths])


def load_mixture(path: str | Path) -> Mixture:
    """A mixture file (JSON, or YAML for a .yaml / .yml file: ``{"sources": [...]}`` or the list alone);
    MixtureError naming what is wrong."""
    path = Path(path).expanduser()
    as_yaml = path.suffix in (".yaml", ".yml")
    try:
        text = path.read_text()
        if as_yaml:
            import yaml

            spec = yaml.safe_load(text)   # plain data only: no tags, no objects
        else:
            spec = json.loads(text)
    except OSError as exc:
        raise MixtureError(f"mixture file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise MixtureError(f"mixture file {path}: not JSON ({exc})") from None
    except Exception as exc:   # yaml.YAMLError: its message names the line and column
        raise MixtureError(f"mixture file {path}: not YAML ({' '.join(str(exc).split())})") from None
    entries = spec.get("sources") if isinstance(spec, dict) else spec
    if not isinstance(entries, list):
        raise MixtureError(f"mixture file {path}: want {{\"sources\": [{{\"dataset\": ...}}, ...]}}")
    if isinstance(spec, dict) and set(spec) - {"sources"}:
        raise MixtureError(f"mixture file {path}: unknown key {sorted(set(spec) - {'sources'})[0]!r} (known: sources)")
    base = path.resolve().parent
    return of_sources([source_from(e, f"mixture file {path} source {i}", base) for i, e in enumerate(entries)], path)
