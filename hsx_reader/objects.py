"""Batch objects, read for training: fetch whole or by byte range, decode to zero-copy views.

A batch object is a safetensors file (see ``hsx.batchfile`` for the layout).
The whole object is read into one uint8 tensor and every stored tensor is a
view of it (``buf[start:end].view(dtype).reshape(shape)``); only a tensor whose
offset is not a multiple of its element size (possible for ``cu_seqlens``,
which follows the uint8 ``loss_mask``) is copied. Byte-range reads use the
header's exact offsets: a sample's rows of every tensor are contiguous.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hsx.batchfile import BatchContents, BatchFileError, validate
from hsx.store import LocalStore, Store
from hsx_reader.run import ReaderError

ST_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
            "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8}
MAX_HEADER = 64 * 2**20  # bytes; a larger header means a corrupt length field
HEADER_PROBE = 64 * 2**10  # bytes fetched first in range mode; covers the header of any real batch


class CorruptBatch(ReaderError):
    """A batch object is truncated, corrupt, or does not match the run; the message names its key."""


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
    key: str
    size: int                      # bytes the header says the object has
    data_start: int                # 8 + header length
    tensors: dict[str, TensorSpec]
    metadata: dict[str, str]

    @property
    def sample_ids(self) -> list[str]:
        return json.loads(self.metadata["sample_ids"])


def parse_header(prefix: bytes | memoryview, key: str) -> Header:
    """Parse a safetensors header from the object's first bytes (all of the header must be there)."""
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
        metadata = raw.pop("__metadata__", {}) or {}
        data_start = 8 + header_len
        tensors, end = {}, 0
        for name, t in raw.items():
            lo, hi = (int(x) for x in t["data_offsets"])
            dtype, shape = ST_TORCH[t["dtype"]], tuple(int(x) for x in t["shape"])
            numel = 1
            for d in shape:
                numel *= d
            if hi - lo != numel * dtype.itemsize or lo < 0:
                raise ValueError(f"tensor {name!r}: offsets {lo}..{hi} do not fit shape {list(shape)}")
            tensors[name] = TensorSpec(dtype, shape, data_start + lo, data_start + hi)
            end = max(end, hi)
        json.loads(metadata["sample_ids"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBatch(f"{key}: corrupt or truncated batch object ({exc})") from None
    for name in ("input_ids", "loss_mask", "cu_seqlens", "hidden_states"):
        if name not in tensors:
            raise CorruptBatch(f"{key}: tensor {name!r} is missing")
    return Header(key, data_start + end, data_start, tensors, metadata)


def _view(buf: torch.Tensor, spec: TensorSpec, base: int = 0) -> torch.Tensor:
    """``spec``'s bytes of ``buf`` (which starts at object offset ``base``) as a tensor, zero-copy if aligned."""
    lo, hi = spec.start - base, spec.end - base
    raw = buf[lo:hi]
    if lo % spec.dtype.itemsize:
        raw = raw.clone()
    return raw.view(spec.dtype).reshape(spec.shape)


def check_against_run(header: Header, manifest: dict) -> None:
    """The object must carry the run's layers, dtype and hidden size."""
    n_layers, hidden = len(manifest["layer_ids"]), int(manifest["hidden_size"])
    problems = []
    if json.loads(header.metadata.get("layer_ids", "null")) not in (None, manifest["layer_ids"]):
        problems.append(f"layer_ids {header.metadata.get('layer_ids')} != run's {manifest['layer_ids']}")
    hs = header.tensors["hidden_states"]
    if len(hs.shape) != 2 or hs.shape[1] != n_layers * hidden:
        problems.append(f"hidden_states shape {list(hs.shape)}, run wants [N, {n_layers * hidden}]")
    if str(hs.dtype).removeprefix("torch.") != manifest["dtype"]:
        problems.append(f"hidden_states dtype {hs.dtype}, run's is {manifest['dtype']}")
    if manifest.get("store_final") and "final_hidden_states" not in header.tensors:
        problems.append("final_hidden_states missing")
    if problems:
        raise CorruptBatch(f"{header.key}: does not match the run's manifest: " + "; ".join(problems))


def decode(buf: torch.Tensor, key: str, manifest: dict | None = None) -> BatchContents:
    """Decode a whole batch object held in a uint8 tensor; tensors are views of ``buf``."""
    header = parse_header(memoryview(buf.numpy())[:min(len(buf), MAX_HEADER + 8)], key)
    if header.size != len(buf):
        raise CorruptBatch(f"{key}: object is {len(buf)} bytes, its header describes {header.size} "
                           f"({'truncated' if len(buf) < header.size else 'trailing bytes'})")
    if manifest is not None:
        check_against_run(header, manifest)
    tensors = {name: _view(buf, spec) for name, spec in header.tensors.items()}
    try:
        validate(tensors, header.sample_ids, check_finite=False)
    except BatchFileError as exc:
        raise CorruptBatch(f"{key}: {exc}") from None
    return BatchContents(input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"],
                         cu_seqlens=tensors["cu_seqlens"], sample_ids=header.sample_ids, metadata=header.metadata,
                         hidden_states=tensors["hidden_states"], final_hidden_states=tensors.get("final_hidden_states"))


def fetch_object(store: Store, key: str) -> torch.Tensor:
    """The whole object as a writable uint8 tensor.

    A local file is memory-mapped copy-on-write: no read, no copy; pages come from the page cache when a
    consumer touches them, and a write to a tensor never reaches the file. A remote object is read into memory.
    """
    if isinstance(store, LocalStore):
        path = Path(store.url(key))
        try:
            with open(path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size == 0:
                    return torch.empty(0, dtype=torch.uint8)
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except FileNotFoundError:
            raise ReaderError(f"{store.url(key)}: batch object is missing from the store") from None
        return torch.frombuffer(mapped, dtype=torch.uint8)
    try:
        data = store.get_bytes(key)
    except KeyError:
        raise ReaderError(f"{store.url(key)}: batch object is missing from the store") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def fetch_header(store: Store, key: str) -> Header:
    """Read only the header (one or two range requests)."""
    try:
        prefix = store.get_bytes(key, 0, HEADER_PROBE)
        if len(prefix) >= 8:
            (header_len,) = struct.unpack("<Q", prefix[:8])
            if 8 + header_len > len(prefix) and header_len <= MAX_HEADER:
                prefix = store.get_bytes(key, 0, 8 + header_len)
    except KeyError:
        raise ReaderError(f"{store.url(key)}: batch object is missing from the store") from None
    return parse_header(prefix, key)


def fetch_rows(store: Store, header: Header, names: list[str], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows ``lo:hi`` of the named [N, ...] tensors, each by one range request of its exact bytes."""
    out = {}
    for name in names:
        spec = header.tensors[name]
        start, end = spec.start + lo * spec.row_bytes, spec.start + hi * spec.row_bytes
        data = store.get_bytes(header.key, start, end)
        if len(data) != end - start:
            raise CorruptBatch(f"{header.key}: asked for bytes {start}..{end} of {name}, got {len(data)} "
                               "(object truncated?)")
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out[name] = buf.view(spec.dtype).reshape((hi - lo,) + spec.shape[1:])
    return out
