"""The batch file: one safetensors file per batch, packed, padding stripped.

Byte layout (standard safetensors, written by hand so tensors go from pinned
host memory to disk without an extra copy, and are hashed on the way)::

    +---------+------------------------------+-------------------------------------------+
    | 8 bytes | header_len bytes             | data: tensors back to back, in this order |
    | u64 LE  | JSON, space-padded to 8      |  hidden_states  [N, n*H]  store dtype (1) |
    | header_ |  {"__metadata__": {...},     |  hidden_scales  [N, n]    F32   (FP8 only)|
    |   len   |   "<name>": {dtype, shape,   |  final_hidden_states [N, H] (optional)(1) |
    |         |     data_offsets}, ...}      |  final_scales   [N, 1]    F32   (FP8 only)|
    |         |                              |  input_ids      [N]       int32           |
    |         |                              |  loss_mask      [N]       uint8           |
    |         |                              |  cu_seqlens     [B+1]     int64           |
    +---------+------------------------------+-------------------------------------------+

    With codec zstd, ``hidden_states.zstd`` [bytes] U8 holds the byte planes back to back:
    +-----------------------------------+----------------------------------------+
    | plane 0: byte 0 of every element  | plane 1: byte 1 of every element (bf16)|
    | (bf16: mantissa; nearly random:   | (bf16: sign + exponent: one zstd frame)|
    |  stored raw when it won't shrink) |                                        |
    +-----------------------------------+----------------------------------------+
    encoding["hidden_states"] = {"codec": "zstd", "dtype": "BF16", "shape": [N, n*H],
                                 "planes": [["raw", N*n*H], ["zstd", <frame bytes>]]}

    (1) store dtype: BF16 (default), F16, F32, or F8_E4M3 with a float32 scale per token per
        layer (value = fp8 * scale; hsx/batch/dtypes.py). With a codec (run's ``codec`` = zstd) the
        tensor is stored instead as ``<name>.zstd`` [bytes] U8: its bytes split into byte planes,
        each a zstd frame or raw (hsx/batch/codec.py); ``__metadata__["encoding"]`` gives, per such tensor,
        {"codec", "dtype", "shape", "planes"} of what it decodes to. Scales and the small tensors are raw.

N = real tokens of the batch, B = samples, H = hidden size, n = captured
layers (concatenated low to high along the last dim). Sample b is rows
``cu_seqlens[b]:cu_seqlens[b+1]``. ``__metadata__`` holds strings only:
format, run, batch_id, sample_ids (JSON list), layer_ids (JSON list), dtype
(what readers get back), store_dtype, codec, model, hidden_size, store_final, incarnation (the run's,
hsx/life/provenance.py: with run, batch_id and sample_ids it proves the file is of this plan), token_sha256
and sample_token_sha256 (the token columns' digests, whole and per sample: hsx/batch/tokens.py),
sample_hidden_crc32 (per sample, its hidden-state rows' CRC-32: hsx/batch/hidden.py; codec none only), encoding
(JSON, codec only). hsx/batch/meta.py's ``BatchMeta`` is the one encoder and parser of these fields.

The same layout (without hidden states) carries a batch's *inputs* from the
producer to the workers (format, run, batch_id, sample_ids, padded_len, token_sha256: ``InputsMeta``).
This module is the one encoder and the one decoder of the format; the training reader (hsx_reader/objects.py) fetches bytes and
calls ``parse_header`` / ``decode_batch`` here.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hsx.batch import codec as codecs
from hsx.batch.check import check_header, check_offsets, check_planes, check_shape
from hsx.batch.dtypes import FP8, FP8_TORCH, ST_CODES, ST_TORCH, VALUE_DTYPES, dequantise_fp8, store_itemsize, tensor_bytes
from hsx.batch.hidden import sample_hidden_crcs
from hsx.batch.meta import (
    FORMAT,
    INPUT_FORMAT,
    SAMPLE_HIDDEN_DIGESTS,
    SAMPLE_TOKEN_DIGESTS,
    TOKEN_DIGEST,
    BatchMeta,
    InputsMeta,
    crcs_json,
    digests_json,
    read_meta,
)
from hsx.batch.tokens import TOKEN_COLUMNS, columns_digest, sample_token_digests

MAX_HEADER = 64 * 2**20  # bytes; a larger header length means a corrupt length field
_TENSOR_ORDER = ("hidden_states", "hidden_scales", "final_hidden_states", "final_scales",
                 "input_ids", "loss_mask", "cu_seqlens")
_ENCODABLE = ("hidden_states", "final_hidden_states")  # tensors a codec applies to


def hidden_bytes_per_token(hidden_size: int, rows: int, store_dtype: str) -> int:
    """Bytes of a token's hidden states as a batch file holds them before any codec: ``rows`` (stored layers
    plus the final state) x H values of ``store_dtype``, plus one float32 scale a row for FP8."""
    return rows * (hidden_size * store_itemsize(store_dtype) + (4 if store_dtype == FP8 else 0))


def stored_bytes_per_token(hidden_size: int, rows: int, store_dtype: str, codec: str = "none") -> int:
    """Bytes a token takes in a batch file, estimated: hidden states (hidden_bytes_per_token) x the codec's
    measured ratio (codec.ESTIMATED_RATIO), + 5 of input id (int32) and loss mask (uint8); headers left out."""
    ratios = codecs.ESTIMATED_RATIO_FP8 if store_dtype == FP8 else codecs.ESTIMATED_RATIO
    return int(round(hidden_bytes_per_token(hidden_size, rows, store_dtype) * ratios[codec])) + 4 + 1


# Part of the error a worker records when an input object's bytes differ from the digest in the plan;
# the producer looks for it to plan that window again (and so rewrite the inputs).
INPUT_DIGEST_MISMATCH = "differ from the SHA-256 the producer recorded"


class BatchFileError(ValueError):
    """A batch file is malformed, or its contents fail validation."""


@dataclass
class BatchContents:
    """A decoded batch (inputs or outputs); tensors on the CPU."""

    input_ids: torch.Tensor          # [N] int32
    loss_mask: torch.Tensor          # [N] uint8
    cu_seqlens: torch.Tensor         # [B+1] int64
    sample_ids: list[str]
    metadata: dict[str, str] = field(default_factory=dict)
    hidden_states: torch.Tensor | None = None        # [N, n*H], values (dequantised, decompressed)
    final_hidden_states: torch.Tensor | None = None  # [N, H]

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def validate_batch(tensors: dict[str, torch.Tensor], sample_ids: list[str], check_finite: bool = True) -> None:
    """Raise BatchFileError unless the tensors form a consistent batch."""
    cu = tensors["cu_seqlens"]
    n_tokens = tensors["input_ids"].shape[0]
    if cu.ndim != 1 or cu.shape[0] != len(sample_ids) + 1:
        raise BatchFileError(f"cu_seqlens has {cu.shape[0]} entries for {len(sample_ids)} samples (want samples + 1)")
    if int(cu[0]) != 0 or int(cu[-1]) != n_tokens or bool((cu[1:] < cu[:-1]).any()):
        raise BatchFileError(f"cu_seqlens must rise from 0 to {n_tokens} tokens, got {cu.tolist()[:4]}...{int(cu[-1])}")
    if tensors["loss_mask"].shape[0] != n_tokens:
        raise BatchFileError(f"loss_mask has {tensors['loss_mask'].shape[0]} tokens, input_ids {n_tokens}")
    for name in ("hidden_states", "final_hidden_states"):
        t = tensors.get(name)
        if t is None:
            continue
        if t.ndim != 2 or t.shape[0] != n_tokens:
            raise BatchFileError(f"{name} has shape {tuple(t.shape)}, want [{n_tokens}, ...]")
        if check_finite and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).any(dim=1).nonzero()[0])
            sample = int(torch.searchsorted(cu, torch.tensor(bad), right=True)) - 1
            raise BatchFileError(f"{name} holds NaN/Inf (first at token {bad}, sample {sample_ids[sample]!r})")


def encode_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                  codec: str = "none") -> tuple[bytes, list[torch.Tensor]]:
    """Return (8-byte length + JSON header, tensors in data order); ``codec`` compresses the hidden states here.

    ``metadata`` is a record's ``to_metadata()`` (hsx/batch/meta.py); the token digests are added here, from the
    tensors (hsx/batch/tokens.py): the whole batch's to both kinds of file, the per-sample ones to a batch of
    hidden states (read by range for training; an inputs file is read whole, against its SHA-256 in the plan), and
    to such a batch stored without a codec its hidden-state rows' CRC-32 per sample (hsx/batch/hidden.py).
    """
    metadata = dict(metadata)
    tensors = {name: t.contiguous() for name, t in tensors.items()}  # no copy of a contiguous one
    if all(name in tensors for name in TOKEN_COLUMNS):
        metadata[TOKEN_DIGEST] = columns_digest(tensors)
        if metadata.get("format") == FORMAT:
            digests = sample_token_digests(*(tensors[name] for name in TOKEN_COLUMNS))
            if digests is not None:
                metadata[SAMPLE_TOKEN_DIGESTS] = digests_json(digests)
    if metadata.get("format") == FORMAT and codec == "none":
        crcs = sample_hidden_crcs(tensors)
        if crcs is not None:
            metadata[SAMPLE_HIDDEN_DIGESTS] = crcs_json(crcs)
    header: dict[str, object] = {}
    encoding: dict[str, dict] = {}
    ordered, offset = [], 0
    for name in _TENSOR_ORDER:
        t = tensors.get(name)
        if t is None:
            continue
        if t.dtype not in ST_CODES:
            raise BatchFileError(f"{name}: dtype {t.dtype} cannot be stored")
        stored_name = name
        if codec != "none" and name in _ENCODABLE:
            stored, planes = codecs.encode(t, codec)
            encoding[name] = {"codec": codec, "dtype": ST_CODES[t.dtype], "shape": list(t.shape), "planes": planes}
            t, stored_name = stored, f"{name}.{codec}"
        nbytes = t.numel() * t.element_size()
        header[stored_name] = {"dtype": ST_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        ordered.append(t.contiguous())
    if encoding:
        metadata["encoding"] = json.dumps(encoding, separators=(",", ":"))
    raw = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ordered


# sha256 runs on a helper thread beside the write (both release the GIL), in
# chunks of HASH_CHUNK bytes, in order; False hashes then writes on one thread.
HASH_IN_PARALLEL = True
HASH_CHUNK = 64 * 2**20
_hashers = threading.local()  # one single-thread hasher per writing thread: chunks stay in order


def _hash_pool() -> ThreadPoolExecutor:
    pool = getattr(_hashers, "pool", None)
    if pool is None:
        pool = _hashers.pool = ThreadPoolExecutor(1, thread_name_prefix="hsx-sha256")
    return pool


def _write_hashed(fh, digest, views: list[memoryview]) -> None:
    """Write ``views`` to ``fh`` and feed them to ``digest`` in order, hashing on a helper thread."""
    if not HASH_IN_PARALLEL:
        for view in views:
            digest.update(view)
            fh.write(view)
        return
    pending = []
    try:
        for view in views:
            for start in range(0, len(view), HASH_CHUNK):
                chunk = view[start:start + HASH_CHUNK]
                pending.append(_hash_pool().submit(digest.update, chunk))
                fh.write(chunk)
    finally:
        for fut in pending:
            fut.result()


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], fsync: bool = True,
                 tmp_tag: str | None = None, codec: str = "none") -> tuple[int, str]:
    """Write a batch file at ``path`` via ``<name>.tmp-<tmp_tag or pid>`` and rename.

    Returns (size in bytes, sha256 hex of the whole file). A failure (disk
    full, ...) leaves no file at ``path`` and removes the temp file.
    """
    head, ordered = encode_header(tensors, metadata, codec)
    digest = hashlib.sha256(head)
    tmp = path.with_name(f"{path.name}.tmp-{tmp_tag or os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        try:
            fh = open(tmp, "wb")
        except FileNotFoundError:  # the folder went meanwhile: a stopping role removed it empty (hsx/runspec/spool.py)
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(tmp, "wb")
        with fh:
            fh.write(head)
            _write_hashed(fh, digest, [tensor_bytes(t) for t in ordered])
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, digest.hexdigest()


def batch_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str], codec: str = "none") -> bytes:
    head, ordered = encode_header(tensors, metadata, codec)
    return head + b"".join(bytes(tensor_bytes(t)) for t in ordered)


# ---- the decoder ---------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset from the start of the object
    end: int

    @property
    def row_bytes(self) -> int:
        return (self.end - self.start) // max(self.shape[0], 1)


@dataclass(frozen=True)
class Header:
    key: str                       # where the object is (names it in errors)
    size: int                      # bytes the header says the object has
    data_start: int                # 8 + header length
    tensors: dict[str, TensorSpec]  # as stored (an encoded tensor under ``<name>.<codec>``)
    metadata: dict[str, str]
    encoding: dict[str, dict]      # tensor name -> {"codec", "dtype", "shape"} of what it decodes to
    meta: BatchMeta | InputsMeta   # ``metadata`` parsed (InputsMeta for a producer's inputs file)

    @property
    def sample_ids(self) -> list[str]:
        return list(self.meta.sample_ids)

    def has(self, name: str) -> bool:
        return name in self.tensors or name in self.encoding

    def stored(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of tensor ``name`` once decoded from its codec (FP8 stays FP8)."""
        if name in self.encoding:
            enc = self.encoding[name]
            return ST_TORCH[enc["dtype"]], tuple(enc["shape"])
        spec = self.tensors[name]
        return spec.dtype, spec.shape

    @property
    def value_dtype(self) -> torch.dtype:
        """What ``decode_batch`` gives for the hidden states: the run's dtype, also for FP8 files."""
        dtype = self.meta.dtype if isinstance(self.meta, BatchMeta) else None
        return VALUE_DTYPES.get(dtype or "", torch.bfloat16)


def parse_header(prefix: bytes | memoryview, key: str, outputs: bool = True) -> Header:
    """Parse the header from the object's first bytes (all of the header must be there).

    ``outputs``: the batch must carry hidden states (False for a producer's inputs file).
    """
    prefix = memoryview(prefix)
    try:
        if len(prefix) < 8:
            raise ValueError(f"only {len(prefix)} bytes, shorter than the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix[:8])
        if header_len > MAX_HEADER:
            raise ValueError(f"header length {header_len} is implausible")
        if 8 + header_len > len(prefix):
            raise ValueError(f"header of {header_len} bytes runs past the {len(prefix)} bytes read")
        raw = json.loads(bytes(prefix[8:8 + header_len]))
        if not isinstance(raw, dict):
            raise ValueError("header is not a JSON object")
        metadata = raw.pop("__metadata__", {}) or {}
        data_start = 8 + header_len
        tensors, end = {}, 0
        for name, t in raw.items():
            lo, hi = check_offsets(name, t["data_offsets"])
            dtype, shape = ST_TORCH[t["dtype"]], check_shape(name, t["shape"])
            numel = 1
            for d in shape:
                numel *= d
            if hi - lo != numel * dtype.itemsize or lo < 0:
                raise ValueError(f"tensor {name!r}: offsets {lo}..{hi} do not fit shape {list(shape)}")
            tensors[name] = TensorSpec(dtype, shape, data_start + lo, data_start + hi)
            end = max(end, hi)
        encoding = json.loads(metadata.get("encoding", "{}"))
        for name, enc in encoding.items():
            codecs.check_codec(enc["codec"])
            ST_TORCH[enc["dtype"]], check_shape(name, enc["shape"])  # noqa: B018 - validates
            stored = tensors.get(f"{name}.{enc['codec']}")
            if stored is None or name not in _ENCODABLE:
                raise ValueError(f"encoded tensor {name}.{enc['codec']} is missing or not one a codec applies to")
            check_planes(name, enc.get("planes"), stored.end - stored.start)
        if metadata.get("format") not in (FORMAT, INPUT_FORMAT):
            raise ValueError(f"not an hsx batch file (format={metadata.get('format')!r})")
        header = Header(key, data_start + end, data_start, tensors, metadata, encoding, read_meta(metadata))
        check_header(header)  # dtypes, ranks, shapes against the token count: before anything is allocated
    except (ValueError, KeyError, TypeError, RecursionError, AttributeError) as exc:
        raise BatchFileError(f"{key}: corrupt or truncated batch file ({type(exc).__name__}: {exc})") from None
    for name in ("input_ids", "loss_mask", "cu_seqlens") + (("hidden_states",) if outputs else ()):
        if not header.has(name):
            raise BatchFileError(f"{key}: tensor {name!r} is missing")
    return header


def view(buf: torch.Tensor, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """``spec``'s bytes of ``buf`` (which starts at object offset ``base``) as a tensor, zero-copy if aligned."""
    lo, hi = spec.start - base, spec.end - base
    raw = buf[lo:hi]
    if lo % spec.dtype.itemsize:
        raw = raw.clone()
    return raw.view(spec.dtype).reshape(spec.shape)


def stored_values(header: Header, name: str, stored: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """A hidden-state tensor as the run's values: FP8 times its scales, in the run's dtype."""
    if stored.dtype == FP8_TORCH:
        if scales is None:
            raise BatchFileError(f"{header.key}: {name} is FP8 but its scales are missing")
        if scales.ndim != 2 or scales.shape[0] != stored.shape[0] or stored.shape[1] % max(scales.shape[1], 1):
            raise BatchFileError(f"{header.key}: scales {list(scales.shape)} do not fit {name} {list(stored.shape)}")
        return dequantise_fp8(stored, scales, header.value_dtype)
    return stored


def decode_tensor(buf: torch.Tensor, header: Header, name: str, base: int = 0) -> torch.Tensor:
    """Tensor ``name`` as stored (codec undone, FP8 kept), from ``buf`` holding the object from offset ``base``."""
    if name in header.encoding:
        enc = header.encoding[name]
        spec = header.tensors[f"{name}.{enc['codec']}"]
        try:
            return codecs.decode(buf[spec.start - base:spec.end - base], enc["codec"], *header.stored(name),
                                 planes=enc.get("planes"))
        except ValueError as exc:
            raise BatchFileError(f"{header.key}: {name}: {exc}") from None
    return view(buf, header.tensors[name], base)


def decode_batch(buf: torch.Tensor, where: str = "<bytes>", outputs: bool | None = None) -> BatchContents:
    """Decode a whole batch object held in a uint8 tensor.

    Small tensors (and uncompressed non-FP8 hidden states) are zero-copy views of ``buf``;
    compressed tensors are decompressed, FP8 ones dequantised to the run's dtype.
    """
    header = parse_header(memoryview(buf.numpy())[:min(len(buf), MAX_HEADER + 8)], where, outputs=bool(outputs))
    if header.size != len(buf):
        raise BatchFileError(f"{where}: corrupt or truncated batch file: {len(buf)} bytes, its header describes {header.size} "
                             f"({'truncated' if len(buf) < header.size else 'trailing bytes'})")
    tensors = {name: decode_tensor(buf, header, name)
               for name in ("input_ids", "loss_mask", "cu_seqlens") if header.has(name)}
    for name, scale_name in (("hidden_states", "hidden_scales"), ("final_hidden_states", "final_scales")):
        if header.has(name):
            scales = decode_tensor(buf, header, scale_name) if header.has(scale_name) else None
            tensors[name] = stored_values(header, name, decode_tensor(buf, header, name), scales)
    try:
        validate_batch(tensors, header.sample_ids, check_finite=False)
    except BatchFileError as exc:
        raise BatchFileError(f"{where}: corrupt batch file: {exc}") from None
    return BatchContents(input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"],
                         cu_seqlens=tensors["cu_seqlens"], sample_ids=header.sample_ids, metadata=header.metadata,
                         hidden_states=tensors.get("hidden_states"),
                         final_hidden_states=tensors.get("final_hidden_states"))


def read_batch_bytes(data: bytes | bytearray | memoryview, where: str = "<bytes>") -> BatchContents:
    """Decode a batch file held in memory; ``where`` names it in errors."""
    with warnings.catch_warnings():  # read-only bytes: the views are never written
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return decode_batch(buf, where)


HEADER_PROBE = 64 * 2**10  # bytes: the first read of an object covers the header of any real batch


def header_length(prefix: bytes) -> int:
    """Bytes from the start of the object that hold the whole header (8 + its declared length)."""
    return 8 + struct.unpack("<Q", prefix[:8])[0] if len(prefix) >= 8 else 8


def read_header(get_range, key: str, outputs: bool = True) -> Header:
    """The header of a stored batch object, in one range read (two when the header is over HEADER_PROBE).

    ``get_range(start, length) -> bytes`` reads the object (a store's ``get_bytes`` bound to ``key``); the
    format takes a callable so it never imports a store. Raises BatchFileError on a corrupt header and lets
    the store's own errors (ObjectNotFound, a KeyError: no such object) through. ``outputs=False``: a batch's inputs object.
    """
    prefix = get_range(0, HEADER_PROBE)
    need = header_length(prefix)
    if len(prefix) < need <= MAX_HEADER + 8:
        prefix = get_range(0, need)
    return parse_header(prefix, key, outputs=outputs)
