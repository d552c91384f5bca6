"""The run manifest: what a run is, so that a resume against something else is refused."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType

from hsx import __version__
from hsx import defaults as D
from hsx.errors import HsxError
from hsx.runspec.config import ConfigError, StoreSettings
from hsx.runspec.targetmodel import looks_like_path

# The manifest's version, kept in its "format" field. Bump it when a field changes meaning or a new field
# changes what a role must do: an hsx that reads an older version refuses a newer one (ManifestError), while
# keys it does not know under its own version are kept as read and written back (Manifest.extra).
FORMAT = "hsx-run/1"
FP8 = D.STORE_DTYPES[-1]   # "float8_e4m3": one byte a value plus a float32 scale a token a layer (hsx/batch/dtypes.py)

# Fields that define the run's output; a resume must agree on every one.
IDENTITY_FIELDS = ("model_config_hash", "layer_ids", "store_final", "dtype", "store_dtype", "codec", "hidden_size", "num_layers",
                   "max_length", "overlong", "token_budget", "pad_multiple", "max_batch_rows", "batches_per_shard",
                   "dataset_fingerprint", "chat_template_hash", "store_url", "template_kwargs", "columns",
                   "window_rows", "compute_dtype", "fp8_accumulation", "mixture", "per_turn")
# Fields written only when they differ from this value (the value of every manifest written before them).
OMITTED_AT = {"per_turn": False, "prefix_stored_tokens": 0, "prefix_rows": "padded"}
log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()   # (run, field) whose relative path was reported: once a process


class ManifestError(HsxError, ValueError):
    """A manifest this hsx cannot read: not JSON, a field missing or of the wrong type, or a newer format."""


class ManifestMismatch(HsxError, RuntimeError):
    """A run exists with a different manifest."""


@dataclass(frozen=True)
class RunLimits:
    """Limits every role of a run must agree on, set by `hsx produce` and kept in the manifest.

    ``max_attempts``: failures of a batch, whoever saw them (an extract job that raised, a worker
    lost with its lease, a spool file lost before upload: each costs one extraction), before the
    batch goes to dead letters. ``lease_seconds``: how long a lease lives without a refresh.
    """

    max_attempts: int = D.DEFAULT_MAX_ATTEMPTS
    lease_seconds: int = D.DEFAULT_LEASE_SECONDS

    def to_dict(self) -> dict:
        return {"max_attempts": self.max_attempts, "lease_seconds": self.lease_seconds}


# JSON types of the fields (a bool is never an int here). OPTIONAL fields may be absent from manifests older
# hsx versions wrote (or null); Manifest.from_dict gives them the value those versions meant.
_INT, _STR, _BOOL, _DICT = (int,), (str,), (bool,), (dict,)
REQUIRED = {"run": _STR, "model": _STR, "model_config_hash": _STR, "model_type": _STR, "num_layers": _INT,
            "hidden_size": _INT, "layer_preset": _STR, "layer_ids": (list,), "store_final": _BOOL, "dtype": _STR,
            "max_length": _INT, "overlong": _STR, "token_budget": _INT, "pad_multiple": _INT, "max_batch_rows": _INT,
            "batches_per_shard": _INT, "dataset": _STR, "dataset_fingerprint": _STR, "chat_template_hash": _STR,
            "pad_token_id": _INT, "store_url": _STR, "store": _DICT, "hsx_version": _STR, "created": _STR}
OPTIONAL = {"store_dtype": _STR, "codec": _STR, "compute_dtype": _STR, "fp8_accumulation": _STR, "limits": _DICT, "template_kwargs": _DICT,
            "columns": _DICT, "window_rows": _INT, "format": _STR, "incarnation": _STR, "model_weights": _STR,
            "mixture": (list,), "per_turn": _BOOL, "prefix_reuse": _STR, "prefix_min_tokens": _INT,
            "prefix_forward_tokens": _INT, "prefix_stored_tokens": _INT, "prefix_rows": _STR,
            "prefix_cache_tokens": _INT}


@dataclass(frozen=True)
class Manifest:
    """What a run is: written once by `hsx produce` (Redis ``hsx:<run>:manifest`` and ``<run>/manifest.json``
    in the store, the same JSON), read by every role. Paths are absolute (docs/architecture.md, rule 8).

    Read and written only here: ``from_dict``/``from_json`` (old manifests included) and ``to_dict``/``to_json``.
    """

    run: str
    model: str                  # absolute local folder or hub id
    model_config_hash: str      # config_hash() of the model (hsx/runspec/targetmodel.py)
    model_type: str             # the text config's model_type
    num_layers: int             # decoder layers of the target
    hidden_size: int            # H
    layer_preset: str           # --layers as given (dflash, eagle3, 1,9,17+final, ...)
    layer_ids: tuple[int, ...]  # 0-based decoder-layer outputs stored, low to high
    store_final: bool           # the final (normed) hidden state is stored too
    dtype: str                  # what readers get back: bfloat16, float16 or float32
    store_dtype: str            # what batch files hold: dtype or float8_e4m3 (older manifests: dtype)
    codec: str                  # lossless codec of the hidden states: none or zstd
    compute_dtype: str          # the target's linear layers: bfloat16 or float8
    fp8_accumulation: str       # how float8 GEMMs accumulate: fp32 or fast (older float8 manifests: fast, as they ran)
    max_length: int             # tokens a sample
    overlong: str               # drop | truncate
    token_budget: int           # padded tokens a batch
    pad_multiple: int
    max_batch_rows: int
    batches_per_shard: int
    window_rows: int | None     # rows planned together; None: planned before windows (one sort of the whole set)
    dataset: str                # absolute path of the input
    dataset_fingerprint: str
    chat_template_hash: str
    template_kwargs: Mapping    # chat-template arguments
    columns: Mapping            # instruction-column mapping (hsx.prep.columns), {} for none
    pad_token_id: int
    store_url: str              # the store, as a URL or absolute path (identity)
    store: StoreSettings        # how to open it (endpoint, region, ...; no credentials)
    limits: RunLimits
    hsx_version: str            # of the producer that planned the run
    created: str                # ISO 8601, UTC
    # A random id minted when the run is first planned (and again after `hsx reset`): every batch file of the
    # run carries it, so a file of an earlier incarnation of the same run name is never taken as this one's.
    # "" in manifests older hsx wrote: their files are checked by run, batch id and sample ids only.
    incarnation: str = ""
    # weights_fingerprint() of the model's weight files; "" in manifests older hsx wrote (the first `hsx produce`
    # of this hsx records it: docs/reliability.md).
    model_weights: str = ""
    # A mixture's sources (hsx.prep.mixture), in order: {name, dataset (absolute), fingerprint, and the columns,
    # template_kwargs, rows / share + seed it was given}; () for one --dataset, left out of the JSON as before.
    mixture: tuple = ()
    per_turn: bool = False      # one sample a turn of each row (hsx/prep/perturn.py); absent (False) in older ones
    # Shared prefixes computed once (hsx/prep/prefixplan.py): "on" or "off" (manifests older hsx wrote,
    # written only when on); spines of at least prefix_min_tokens, at most prefix_cache_tokens cached a batch,
    # a tree made where it saves more than prefix_forward_tokens a forward (0: a run planned before it was
    # recorded, planned at LEGACY_PREFIX_FORWARD_TOKENS: ``forward_tokens`` says which); a batch of trees stores
    # at most prefix_stored_tokens (0: the token budget, as runs planned before it was recorded: ``stored_tokens``).
    prefix_reuse: str = "off"
    prefix_min_tokens: int = 0
    prefix_cache_tokens: int = 0
    prefix_forward_tokens: int = 0
    prefix_stored_tokens: int = 0
    # how the workers run a tree batch's rows, planned for (hsx.defaults.PREFIX_ROWS): "packed", or "padded" (as
    # runs planned before it was recorded were; written only when packed)
    prefix_rows: str = "padded"
    extra: Mapping = field(default_factory=lambda: MappingProxyType({}))  # keys of a newer hsx, kept as read

    def __post_init__(self):
        check_values(self)

    # ---- derived facts -------------------------------------------------------------------------------
    @property
    def stored_rows(self) -> int:
        """Hidden-state rows a token stores: one a layer, plus the final state."""
        return len(self.layer_ids) + int(self.store_final)

    @property
    def stored_layer_names(self) -> list:
        """The stored rows by name: the layer ids, then "final" when the final state is stored."""
        return [*self.layer_ids, "final"] if self.store_final else list(self.layer_ids)

    @property
    def width(self) -> int:
        """Columns of ``hidden_states``: the layers side by side (the final state is a tensor of its own)."""
        return len(self.layer_ids) * self.hidden_size

    @property
    def fp8_store(self) -> bool:
        return self.store_dtype == FP8

    @property
    def host_bytes_per_token(self) -> int:
        """Bytes a token's stored tensors take in host memory before the codec (hidden states, FP8 scales, final)."""
        from hsx.batch import hidden_bytes_per_token

        return hidden_bytes_per_token(self.hidden_size, self.stored_rows, self.store_dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes a token takes in a batch file, estimated (the codec's measured ratio; headers left out)."""
        from hsx.batch import stored_bytes_per_token

        return stored_bytes_per_token(self.hidden_size, self.stored_rows, self.store_dtype, self.codec)

    # ---- reading and writing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data, where: str = "manifest") -> Manifest:
        """A manifest as any hsx wrote it; ManifestError (one line naming ``where``) if it cannot be one."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: not a JSON object ({type(data).__name__})")
        fmt = data.get("format", FORMAT)   # manifests have always had it; a hand-written one may not
        if fmt != FORMAT:
            version = fmt.removeprefix("hsx-run/") if isinstance(fmt, str) else ""
            if version.isdigit() and int(version) > int(FORMAT.removeprefix("hsx-run/")):
                raise ManifestError(f"{where}: format {fmt} is newer than this hsx {__version__} reads ({FORMAT}); "
                                    "upgrade hsx on this host")
            raise ManifestError(f"{where}: format {fmt!r} is not an hsx run manifest ({FORMAT})")
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise ManifestError(f"{where}: no {', '.join(missing)} (not a manifest `hsx produce` wrote)")
        for name, types in (*REQUIRED.items(), *OPTIONAL.items()):
            value = data.get(name)
            if name in data and not (name in OPTIONAL and value is None) and (
                    not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                raise ManifestError(f"{where}: {name} is {value!r:.60}, not {' or '.join(t.__name__ for t in types)}")
        too_long = [k for k, v in data.items() if k in REQUIRED or k in OPTIONAL
                    if isinstance(v, str) and len(v) > MAX_TEXT]
        if too_long:
            raise ManifestError(f"{where}: {too_long[0]} is {len(data[too_long[0]])} characters long, at most {MAX_TEXT}")
        empty = [k for k in ("model", "dataset", "store_url") if not data[k]]   # before they are resolved as paths
        if empty:
            raise ManifestError(f"{where}: {empty[0]} is '', not a path")
        if len(data["layer_ids"]) > MAX_LAYERS:
            raise ManifestError(f"{where}: layer_ids holds {len(data['layer_ids'])} ids, at most {MAX_LAYERS}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in data["layer_ids"]):
            raise ManifestError(f"{where}: layer_ids {data['layer_ids']!r:.60} are not all integers")
        limits = {**RunLimits().to_dict(), **(data.get("limits") or {})}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in limits.values()):
            raise ManifestError(f"{where}: limits {data['limits']!r:.60} are not all integers")
        run = data["run"]
        try:
            store = StoreSettings.resolve(None, recorded=data["store"])
        except ConfigError as exc:
            raise ManifestError(f"{where}: store: {exc}") from None
        known = {*REQUIRED, *OPTIONAL}
        try:
            return cls(
                run=run, model=_absolute(run, "model", data["model"]), model_config_hash=data["model_config_hash"],
                model_type=data["model_type"], num_layers=data["num_layers"], hidden_size=data["hidden_size"],
                layer_preset=data["layer_preset"], layer_ids=tuple(data["layer_ids"]), store_final=data["store_final"],
                dtype=data["dtype"], store_dtype=data.get("store_dtype") or data["dtype"],
                codec=data.get("codec") or "none", compute_dtype=data.get("compute_dtype") or "bfloat16",
                fp8_accumulation=data.get("fp8_accumulation") or _older_fp8_accumulation(data),
                max_length=data["max_length"], overlong=data["overlong"], token_budget=data["token_budget"],
                pad_multiple=data["pad_multiple"], max_batch_rows=data["max_batch_rows"],
                batches_per_shard=data["batches_per_shard"], window_rows=data.get("window_rows"),
                dataset=_absolute(run, "dataset", data["dataset"]), dataset_fingerprint=data["dataset_fingerprint"],
                chat_template_hash=data["chat_template_hash"],
                template_kwargs=MappingProxyType(dict(data.get("template_kwargs") or {})),
                columns=MappingProxyType(dict(data.get("columns") or {})), pad_token_id=data["pad_token_id"],
                store_url=_absolute(run, "store_url", data["store_url"]),
                store=replace(store, url=_absolute(run, "store", store.url)),
                limits=RunLimits(limits["max_attempts"], limits["lease_seconds"]),
                hsx_version=data["hsx_version"], created=data["created"],
                incarnation=data.get("incarnation") or "", model_weights=data.get("model_weights") or "",
                mixture=_mixture(data.get("mixture") or []),
                per_turn=bool(data.get("per_turn")),
                prefix_reuse=data.get("prefix_reuse") or "off", prefix_min_tokens=data.get("prefix_min_tokens") or 0,
                prefix_cache_tokens=data.get("prefix_cache_tokens") or 0,
                prefix_forward_tokens=data.get("prefix_forward_tokens") or 0,
                prefix_stored_tokens=data.get("prefix_stored_tokens") or 0,
                prefix_rows=data.get("prefix_rows") or "padded",
                extra=MappingProxyType({k: v for k, v in data.items() if k not in known}))
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "manifest") -> Manifest:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ManifestError(f"{where}: not valid JSON ({exc})") from None
        return cls.from_dict(data, where)

    @property
    def forward_tokens(self) -> int:
        """The price of a forward the run's trees were planned at (hsx/prep/prefixplan.py)."""
        from hsx.defaults import LEGACY_PREFIX_FORWARD_TOKENS

        return self.prefix_forward_tokens or LEGACY_PREFIX_FORWARD_TOKENS

    @property
    def rows_packed(self) -> bool:
        """Whether the run's trees were planned for workers that pack rows (``hsx produce --prefix-rows``)."""
        return self.prefix_rows == "packed"

    @property
    def stored_tokens(self) -> int:
        """The most tokens a batch of shared-prefix trees stores (its forwards each compute at most a budget)."""
        return self.prefix_stored_tokens or self.token_budget

    def to_dict(self) -> dict:
        """The JSON object, keys as every hsx wrote them (a window_rows of None is left out, as it was)."""
        out = {**self.extra, "format": FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (f.name == "window_rows" and value is None) or (
                    f.name in ("incarnation", "model_weights", "mixture") and not value) or (
                    f.name in OMITTED_AT and value == OMITTED_AT[f.name]) or (   # as older hsx wrote it
                    f.name.startswith("prefix_") and self.prefix_reuse == "off"):
                continue
            if isinstance(value, (StoreSettings, RunLimits)):
                value = value.to_dict()
            elif isinstance(value, Mapping):
                value = dict(value)
            elif isinstance(value, tuple):
                value = [dict(v) for v in value] if f.name == "mixture" else list(value)
            out[f.name] = value
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def load(cls, store, run: str) -> Manifest | None:
        """``<run>/manifest.json`` from a store (hsx.store.Store), or None if it has none."""
        from hsx.store import ObjectNotFound, layout

        key = layout.manifest_key(run)
        try:
            raw = store.get_bytes(key)
        except ObjectNotFound:
            return None
        return cls.from_json(raw, store.url(key))

    def save(self, store) -> None:
        """Write ``<run>/manifest.json`` into the store (the same bytes for the same manifest)."""
        from hsx.store import layout

        store.put_bytes(layout.manifest_key(self.run), self.to_json(indent=2).encode())


# Bounds of a manifest's values (check_values): far above any real model or run, low enough that a value past
# them is a hand edit or a forgery, never a setting.
MAX_TEXT = 4096            # characters of a path, URL, name or digest (Linux PATH_MAX)
MAX_LAYERS = 4096          # decoder layers of a model (and so layer ids)
MAX_HIDDEN_SIZE = 2**20    # H
MAX_LEASE_SECONDS = 86400  # as `hsx produce --lease-seconds`: a longer lease would keep a dead worker's batch for days
MAX_ATTEMPTS = 100         # as `hsx produce --max-attempts`
_HEX = frozenset("0123456789abcdef")


def _bad(name: str, value, want: str) -> ManifestError:
    return ManifestError(f"{name} is {value!r:.60}, {want}")


def check_values(m: Manifest) -> None:
    """ManifestError naming the first field whose value no hsx run can have (types are checked by from_dict).

    Called on every Manifest built (read from Redis or the store, or planned): a hand edit or a write by
    anyone who can reach Redis is refused here, before a worker spools batches with it.
    """
    from hsx.store import layout

    try:
        layout.check_run_name(m.run)
    except HsxError:
        raise _bad("run", m.run, "not a run name (1-64 letters, digits, '_' or '-')") from None
    for name in ("model", "model_type", "layer_preset", "dataset", "dataset_fingerprint", "chat_template_hash",
                 "store_url", "hsx_version", "created"):
        value = getattr(m, name)
        if not value or len(value) > MAX_TEXT:
            raise _bad(name, value, f"not 1 to {MAX_TEXT} characters")
    if len(m.model_config_hash) != 64 or not set(m.model_config_hash) <= _HEX:
        raise _bad("model_config_hash", m.model_config_hash, "not a SHA-256 (64 hex digits)")
    if not 1 <= m.num_layers <= MAX_LAYERS:
        raise _bad("num_layers", m.num_layers, f"not 1 to {MAX_LAYERS}")
    if not 1 <= m.hidden_size <= MAX_HIDDEN_SIZE:
        raise _bad("hidden_size", m.hidden_size, f"not 1 to {MAX_HIDDEN_SIZE}")
    ids = list(m.layer_ids)
    if not ids:
        raise _bad("layer_ids", ids, "empty: a run stores at least one layer")
    if len(ids) > m.num_layers:
        raise ManifestError(f"layer_ids holds {len(ids)} ids, more than the model's {m.num_layers} layers")
    out_of_range = [i for i in ids if not 0 <= i < m.num_layers]
    if out_of_range:
        raise ManifestError(f"layer_ids {out_of_range[:5]} are out of range for num_layers {m.num_layers} "
                            f"(valid: 0..{m.num_layers - 1})")
    if ids != sorted(set(ids)):
        raise _bad("layer_ids", ids, "not distinct and rising (low to high, each layer once)")
    choices = {"dtype": tuple(D.STORE_DTYPES[:-1]), "store_dtype": (m.dtype, FP8), "codec": D.CODECS,
               "compute_dtype": D.COMPUTE_DTYPES, "fp8_accumulation": D.FP8_ACCUMULATIONS,
               "overlong": ("drop", "truncate"), "prefix_reuse": ("on", "off"),
               "prefix_rows": D.PREFIX_ROWS}
    for name, allowed in choices.items():
        if getattr(m, name) not in allowed:
            raise _bad(name, getattr(m, name), f"not one of {', '.join(dict.fromkeys(allowed))}")
    from hsx.defaults import MAX_TOKEN_BUDGET

    bounds = {"max_length": (1, MAX_TOKEN_BUDGET), "token_budget": (max(m.max_length, 1), MAX_TOKEN_BUDGET),
              "pad_multiple": (1, 4096), "max_batch_rows": (1, MAX_TOKEN_BUDGET), "batches_per_shard": (1, 10**6),
              "window_rows": (1, 2**40), "pad_token_id": (0, 2**31 - 1),
              "prefix_min_tokens": (0, MAX_TOKEN_BUDGET), "prefix_cache_tokens": (0, 2**40),
              "prefix_forward_tokens": (0, MAX_TOKEN_BUDGET), "prefix_stored_tokens": (0, MAX_TOKEN_BUDGET)}
    for name, (low, high) in bounds.items():
        value = getattr(m, name)
        if value is not None and not low <= value <= high:
            raise _bad(name, value, f"not {low} to {high}")
    if not 1 <= m.limits.max_attempts <= MAX_ATTEMPTS:
        raise _bad("limits.max_attempts", m.limits.max_attempts, f"not 1 to {MAX_ATTEMPTS}")
    if not 2 <= m.limits.lease_seconds <= MAX_LEASE_SECONDS:
        raise _bad("limits.lease_seconds", m.limits.lease_seconds, f"not 2 to {MAX_LEASE_SECONDS}")
    if m.incarnation and (len(m.incarnation) != 32 or not set(m.incarnation) <= _HEX):
        raise _bad("incarnation", m.incarnation, "not 32 hex digits")
    if len(m.model_weights) > 128:
        raise _bad("model_weights", m.model_weights, "over 128 characters")
    for name in ("template_kwargs", "columns"):
        size = len(json.dumps(dict(getattr(m, name)), default=str))
        if size > 64 * 1024:
            raise ManifestError(f"{name} is {size} bytes of JSON, at most 65536")
    size = len(json.dumps([dict(x) for x in m.mixture], default=str))
    if size > 64 * 1024:
        raise ManifestError(f"mixture is {size} bytes of JSON, at most 65536")


def _mixture(sources: list) -> tuple:
    """A mixture's sources as read: objects, each with a name, an absolute dataset path and a fingerprint."""
    for i, s in enumerate(sources):
        if not (isinstance(s, dict) and all(isinstance(s.get(k), str) and s.get(k) for k in
                                            ("name", "dataset", "fingerprint"))):
            raise ManifestError(f"mixture source {i} is {s!r:.60}, not an object with name, dataset and fingerprint")
    return tuple(MappingProxyType(dict(s)) for s in sources)


def new_manifest(**fields_) -> Manifest:
    """The manifest of a run planned now, by this hsx."""
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return Manifest(**{"hsx_version": __version__, "created": now, **fields_})


def _older_fp8_accumulation(data: dict) -> str:
    """What a manifest written before the field existed ran with: its float8 GEMMs accumulated fast."""
    return "fast" if data.get("compute_dtype") == "float8" else D.DEFAULT_FP8_ACCUMULATION


def _absolute(run: str, name: str, path: str) -> str:
    """A local path an older hsx recorded relative (an older hsx did): resolved from here, with a warning."""
    if "://" in path and not path.startswith("file://"):
        return path
    local = Path(path.removeprefix("file://")).expanduser()
    if local.is_absolute() or (name == "model" and not looks_like_path(path)):  # a hub id stays as written
        return path
    resolved = str(local.resolve())
    if (run, name) not in _warned:
        _warned.add((run, name))
        log.warning("run %s's %s %s is a relative path (an older hsx planned it): reading it as %s",
                    run, name, path, resolved)
    return ("file://" + resolved) if path.startswith("file://") else resolved


def _identity(name: str, value):
    """What of a field must agree on resume: a mixture's sources less their paths (a source is known by its
    bytes, as a single dataset is: the same file under another path resumes the run)."""
    if name == "mixture" and value:
        return [{k: v for k, v in source.items() if k != "dataset"} for source in value]
    return value


def check_same_run(existing: Manifest, wanted: Manifest) -> None:
    """ManifestMismatch, listing the differences, unless both define the same output."""
    old, new = existing.to_dict(), wanted.to_dict()
    diffs = [f"{k}: run has {old.get(k, OMITTED_AT.get(k))!r}, this call has {new.get(k, OMITTED_AT.get(k))!r}"
             for k in IDENTITY_FIELDS
             if _identity(k, old.get(k, OMITTED_AT.get(k))) != _identity(k, new.get(k, OMITTED_AT.get(k)))]
    # A manifest an older hsx wrote has no weights fingerprint: it resumes, and records this call's.
    if existing.model_weights and wanted.model_weights and existing.model_weights != wanted.model_weights:
        diffs.insert(0, f"model_weights: run has {existing.model_weights} (model {existing.model}), this call has "
                        f"{wanted.model_weights} (model {wanted.model}): another checkpoint")
    if diffs:
        run = wanted.run
        raise ManifestMismatch(f"run {run!r} already exists with a different manifest; refusing to mix outputs. "
                               "Use a new --run name, the original settings, or start it over with `hsx reset --run "
                               f"{run} --store STORE`. Differences:\n  " + "\n  ".join(diffs))
