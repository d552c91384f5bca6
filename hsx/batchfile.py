"""The batch file: one safetensors file per batch, packed, padding stripped.

Byte layout (standard safetensors, written by hand so tensors go from pinned
host memory to disk without an extra copy, and are hashed on the way)::

    +---------+------------------------------+------------------------------------+
    | 8 bytes | header_len bytes             | data                               |
    | u64 LE  | JSON, space-padded to 8      | tensors back to back, in this order|
    | header_ |  {"__metadata__": {...},     |  hidden_states  [N, n*H] bf16      |
    |   len   |   "<name>": {dtype, shape,   |  final_hidden_states [N, H] (opt.) |
    |         |     data_offsets}, ...}      |  input_ids      [N] int32          |
    |         |                              |  loss_mask      [N] uint8          |
    |         |                              |  cu_seqlens     [B+1] int64        |
    +---------+------------------------------+------------------------------------+

N = real tokens of the batch, B = samples, H = hidden size, n = captured
layers (concatenated low to high along the last dim). Sample b is rows
``cu_seqlens[b]:cu_seqlens[b+1]``. ``__metadata__`` holds strings only:
format, run, batch_id, sample_ids (JSON list), layer_ids (JSON list), dtype,
model, hidden_size.

The same layout (without hidden states) carries a batch's *inputs* from the
producer to the workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

FORMAT = "hsx-batch/1"
INPUT_FORMAT = "hsx-input/1"

_ST_DTYPES = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
    torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
}
_TENSOR_ORDER = ("hidden_states", "final_hidden_states", "input_ids", "loss_mask", "cu_seqlens")


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
    hidden_states: torch.Tensor | None = None        # [N, n*H]
    final_hidden_states: torch.Tensor | None = None  # [N, H]

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def validate(tensors: dict[str, torch.Tensor], sample_ids: list[str], check_finite: bool = True) -> None:
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


def encode_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[torch.Tensor]]:
    """Return (8-byte length + JSON header, tensors in data order)."""
    header: dict[str, object] = {"__metadata__": metadata}
    ordered, offset = [], 0
    for name in _TENSOR_ORDER:
        t = tensors.get(name)
        if t is None:
            continue
        if t.dtype not in _ST_DTYPES:
            raise BatchFileError(f"{name}: dtype {t.dtype} cannot be stored")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        ordered.append(t.contiguous())
    raw = json.dumps(header, separators=(",", ":")).encode()
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


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], fsync: bool = True,
                 tmp_tag: str | None = None) -> tuple[int, str]:
    """Write a batch file at ``path`` via ``<name>.tmp-<tmp_tag or pid>`` and rename.

    Returns (size in bytes, sha256 hex of the whole file). A failure (disk
    full, ...) leaves no file at ``path`` and removes the temp file.
    """
    head, ordered = encode_header(tensors, metadata)
    digest = hashlib.sha256(head)
    tmp = path.with_name(f"{path.name}.tmp-{tmp_tag or os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as fh:
            fh.write(head)
            _write_hashed(fh, digest, [_tensor_bytes(t) for t in ordered])
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, digest.hexdigest()


def to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    head, ordered = encode_header(tensors, metadata)
    return head + b"".join(bytes(_tensor_bytes(t)) for t in ordered)


def _decode(tensors: dict[str, torch.Tensor], metadata: dict[str, str], where: str) -> BatchContents:
    for name in ("input_ids", "loss_mask", "cu_seqlens"):
        if name not in tensors:
            raise BatchFileError(f"{where}: tensor {name!r} is missing")
    if metadata.get("format") not in (FORMAT, INPUT_FORMAT):
        raise BatchFileError(f"{where}: not an hsx batch file (format={metadata.get('format')!r})")
    try:
        sample_ids = json.loads(metadata["sample_ids"])
    except (KeyError, ValueError) as exc:
        raise BatchFileError(f"{where}: bad sample_ids metadata ({exc})") from None
    contents = BatchContents(
        input_ids=tensors["input_ids"], loss_mask=tensors["loss_mask"], cu_seqlens=tensors["cu_seqlens"],
        sample_ids=sample_ids, metadata=metadata,
        hidden_states=tensors.get("hidden_states"), final_hidden_states=tensors.get("final_hidden_states"),
    )
    validate(tensors, sample_ids, check_finite=False)
    return contents


def read_bytes(data: bytes, where: str = "<bytes>") -> BatchContents:
    """Decode a batch file held in memory; ``where`` names it in errors."""
    try:
        if len(data) < 8:
            raise ValueError("shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", data[:8])
        if 8 + header_len > len(data):
            raise ValueError(f"header of {header_len} bytes runs past the end ({len(data)} bytes)")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise BatchFileError(f"{where}: corrupt or truncated batch file ({exc})") from None
    return _decode(tensors, metadata, where)


def read_file(path: Path) -> BatchContents:
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as exc:
        raise BatchFileError(f"{path}: corrupt or truncated batch file ({exc})") from None
    return _decode(tensors, metadata, str(path))


def file_sha256(path: Path, chunk: int = 8 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
