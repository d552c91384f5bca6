"""A batch file's header metadata (``__metadata__``), typed: the one place its fields are encoded and parsed.

Two records, one per kind of file (hsx/batch/batchfile.py draws the layout):

- ``BatchMeta``: a batch of hidden states, written by a worker (gpu_worker/writer.py), read by the uploader's
  provenance check, `hsx verify`, the ledger rebuild and the training reader;
- ``InputsMeta``: a batch's packed inputs, written by the producer, read by a worker.

Every value is a string in the header (safetensors' rule): lists are JSON, integers decimal, booleans
``"true"``/``"false"``. ``to_metadata`` leaves out the fields that are None, in a fixed order, so a header
written through a record has the same bytes as the dicts the writers built by hand before it.
``from_metadata`` reads a header of any age: a field an older file lacks is None, a key it does not know is
ignored (a newer file's), a malformed value is a ValueError naming the field (the decoder reports it as a
corrupt file). The token digests and the hidden-state rows' CRC-32s are computed from the tensors as the file is
encoded (``hsx.batch.batchfile.encode_header``, hsx/batch/tokens.py, hsx/batch/hidden.py), never by a writer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

FORMAT = "hsx-batch/1"        # a batch of hidden states
INPUT_FORMAT = "hsx-input/1"  # a batch's inputs
INCARNATION = "incarnation"   # the key of the run's incarnation (hsx/life/provenance.py)
TOKEN_DIGEST = "token_sha256"                # SHA-256 hex of the batch's token columns (hsx/batch/tokens.py)
SAMPLE_TOKEN_DIGESTS = "sample_token_sha256"  # JSON list: per sample, SHA-256 hex of its token rows (tokens.py)
SAMPLE_HIDDEN_DIGESTS = "sample_hidden_crc32"  # JSON list: per sample, CRC-32 (8 hex) of its hidden rows (hidden.py)
_HEX = re.compile(r"[0-9a-f]+")  # lower-case hex, as the encoders write it


@dataclass(frozen=True, kw_only=True)
class BatchMeta:
    """The header of a batch of hidden states. Fields after ``sample_ids`` are None in files that lack them
    (hand-made test files, the upload bench's headers); every worker writes them all."""

    run: str | None
    batch_id: str | None
    sample_ids: tuple[str, ...]          # in row order: sample b is rows cu_seqlens[b]:cu_seqlens[b + 1]
    layer_ids: tuple[int, ...] | None = None   # 0-based decoder layers, concatenated low to high
    dtype: str | None = None             # what readers get back (the run's dtype)
    store_dtype: str | None = None       # as stored (e.g. float8_e4m3, with scales)
    codec: str | None = None             # none or zstd
    model: str | None = None             # the run's model path / hub id
    hidden_size: int | None = None       # H
    store_final: bool | None = None      # final_hidden_states stored
    incarnation: str | None = None       # the run's (proves the file is of this plan: hsx/life/provenance.py)
    token_sha256: str | None = None      # set by the encoder
    sample_token_sha256: bytes | None = None  # set by the encoder: per sample its SHA-256, 32 bytes, back to back
    sample_hidden_crc32: bytes | None = None  # set by the encoder (raw hidden states only): per sample 4 bytes

    def to_metadata(self) -> dict[str, str]:
        fields = {"format": FORMAT, "run": self.run, "batch_id": self.batch_id,
                  "sample_ids": json.dumps(list(self.sample_ids)),
                  "layer_ids": None if self.layer_ids is None else json.dumps(list(self.layer_ids)),
                  "dtype": self.dtype, "store_dtype": self.store_dtype, "codec": self.codec, "model": self.model,
                  "hidden_size": None if self.hidden_size is None else str(self.hidden_size),
                  "store_final": None if self.store_final is None else str(self.store_final).lower(),
                  INCARNATION: self.incarnation, TOKEN_DIGEST: self.token_sha256,
                  SAMPLE_TOKEN_DIGESTS: digests_json(self.sample_token_sha256),
                  SAMPLE_HIDDEN_DIGESTS: crcs_json(self.sample_hidden_crc32)}
        return {key: value for key, value in fields.items() if value is not None}

    @classmethod
    def from_metadata(cls, metadata: dict) -> BatchMeta:
        """The record of a header's ``__metadata__``; ValueError naming a malformed field."""
        _all_strings(metadata)
        sample_ids = _sample_ids(metadata)
        layer_ids = _json(metadata, "layer_ids", "null")
        if layer_ids is not None and (not isinstance(layer_ids, list)
                                      or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)):
            raise ValueError(f"layer_ids {metadata['layer_ids'][:80]!r} is not a JSON list of integers")
        store_final = metadata.get("store_final")
        if store_final not in (None, "true", "false"):
            raise ValueError(f"store_final {store_final[:20]!r} is not true or false")
        return cls(run=metadata.get("run"), batch_id=metadata.get("batch_id"), sample_ids=sample_ids,
                   layer_ids=None if layer_ids is None else tuple(layer_ids), dtype=metadata.get("dtype"),
                   store_dtype=metadata.get("store_dtype"), codec=metadata.get("codec"), model=metadata.get("model"),
                   hidden_size=_positive_int(metadata, "hidden_size"),
                   store_final=None if store_final is None else store_final == "true",
                   incarnation=metadata.get(INCARNATION), token_sha256=metadata.get(TOKEN_DIGEST),
                   sample_token_sha256=_sample_digests(metadata, len(sample_ids)),
                   sample_hidden_crc32=_sample_crcs(metadata, len(sample_ids)))

    def sample_digest(self, row: int) -> str:
        """Sample ``row``'s token digest (hex); the header must have them (``sample_token_sha256`` not None)."""
        return self.sample_token_sha256[32 * row:32 * row + 32].hex()

    def sample_hidden_crc(self, row: int) -> int:
        """Sample ``row``'s hidden rows' CRC-32; the header must have them (``sample_hidden_crc32`` not None)."""
        return int.from_bytes(self.sample_hidden_crc32[4 * row:4 * row + 4], "big")

    @property
    def width(self) -> int | None:
        """len(layer_ids) x hidden_size: the hidden states' row width, where the header names both."""
        return None if self.layer_ids is None or self.hidden_size is None else len(self.layer_ids) * self.hidden_size


@dataclass(frozen=True, kw_only=True)
class InputsMeta:
    """The header of a batch's packed inputs (no hidden states), written by the producer."""

    run: str | None
    batch_id: str | None
    sample_ids: tuple[str, ...]
    padded_len: int | None = None        # tokens a row is padded to on the GPU (hsx/life/ledger.py BatchSpec)
    token_sha256: str | None = None      # set by the encoder

    def to_metadata(self) -> dict[str, str]:
        fields = {"format": INPUT_FORMAT, "run": self.run, "batch_id": self.batch_id,
                  "sample_ids": json.dumps(list(self.sample_ids)),
                  "padded_len": None if self.padded_len is None else str(self.padded_len),
                  TOKEN_DIGEST: self.token_sha256}
        return {key: value for key, value in fields.items() if value is not None}

    @classmethod
    def from_metadata(cls, metadata: dict) -> InputsMeta:
        _all_strings(metadata)
        return cls(run=metadata.get("run"), batch_id=metadata.get("batch_id"), sample_ids=_sample_ids(metadata),
                   padded_len=_positive_int(metadata, "padded_len"), token_sha256=metadata.get(TOKEN_DIGEST))


def read_meta(metadata: dict) -> BatchMeta | InputsMeta:
    """The record of either kind of file, by its ``format``."""
    return (InputsMeta if metadata.get("format") == INPUT_FORMAT else BatchMeta).from_metadata(metadata)


def _all_strings(metadata: dict) -> None:
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("__metadata__ holds a value that is not a string")


def _sample_ids(metadata: dict) -> tuple[str, ...]:
    sample_ids = _json(metadata, "sample_ids")
    if not isinstance(sample_ids, list) or not all(isinstance(s, str) for s in sample_ids):
        raise ValueError("sample_ids is not a JSON list of strings")
    return tuple(sample_ids)


def _positive_int(metadata: dict, name: str) -> int | None:
    value = metadata.get(name)
    if value is None:
        return None
    if not value.isdecimal() or int(value) <= 0:
        raise ValueError(f"{name} {value[:20]!r} is not a positive integer")
    return int(value)


def _per_sample(metadata: dict, name: str, samples: int, width: int, what: str) -> bytes | None:
    """A per-sample digest list (JSON list of ``width``-byte hex strings, one a sample) as its bytes, held as
    ``width`` bytes a sample (not a str each: headers are cached); None when the header has none."""
    values = _json(metadata, name, "null")
    if values is None:
        return None
    if (not isinstance(values, list) or len(values) != samples
            or not all(isinstance(v, str) and len(v) == 2 * width and _HEX.fullmatch(v) for v in values)):
        raise ValueError(f"{name} is not a JSON list of {samples} {what} (one a sample)")
    return bytes.fromhex("".join(values))


def _sample_digests(metadata: dict, samples: int) -> bytes | None:
    return _per_sample(metadata, SAMPLE_TOKEN_DIGESTS, samples, 32, "SHA-256 hex digests")


def _sample_crcs(metadata: dict, samples: int) -> bytes | None:
    return _per_sample(metadata, SAMPLE_HIDDEN_DIGESTS, samples, 4, "CRC-32s (8 hex digits)")


def _per_sample_json(values: bytes | None, width: int) -> str | None:
    return None if values is None else json.dumps([values[i:i + width].hex() for i in range(0, len(values), width)],
                                                  separators=(",", ":"))


def digests_json(digests: bytes | None) -> str | None:
    """The value of ``sample_token_sha256``: a compact JSON list of hex digests (None stays None)."""
    return _per_sample_json(digests, 32)


def crcs_json(crcs: bytes | None) -> str | None:
    """The value of ``sample_hidden_crc32``: a compact JSON list of 8-hex-digit CRC-32s (None stays None)."""
    return _per_sample_json(crcs, 4)


def _json(metadata: dict, name: str, default: str | None = None):
    """A JSON-valued field; a ValueError naming it if it does not parse (KeyError if it is required and absent)."""
    try:
        return json.loads(metadata[name] if default is None else metadata.get(name, default))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not JSON ({exc})") from None
