"""Batch objects, read for training: fetch whole or by byte range; decoding is hsx.batch.batchfile's.

A batch object is a batch file (see ``hsx.batch.batchfile`` for the layout and the one
decoder). The whole object is read into one uint8 tensor and every stored
tensor is a view of it; compressed hidden states are decompressed and FP8 ones
dequantised to the run's dtype. Byte-range reads use the header's exact
offsets: a sample's rows of every uncompressed tensor are contiguous (a
compressed batch is read whole). A sample's hidden-state rows read by range are
checked against the CRC-32 its header recorded for them (hsx/batch/hidden.py).
"""

from __future__ import annotations

import hashlib
import os

import torch

from hsx.batch import (  # noqa: F401 (re-exported)
    FP8,
    HIDDEN_ROWS,
    MAX_HEADER,
    TOKEN_COLUMNS,
    TOKEN_DIGEST,
    BatchContents,
    BatchFileError,
    BatchMeta,
    Header,
    TensorSpec,
    columns_digest,
    decode_batch,
    dtype_name,
    read_header,
    sample_rows_crc32,
    sample_token_digest,
    stored_values,
)
from hsx.batch import parse_header as parse_batch_header
from hsx.runspec import Manifest
from hsx.store import LocalStore, ObjectNotFound, Store
from hsx_reader.run import ReaderError


class CorruptBatch(ReaderError):
    """A batch object is truncated, corrupt, or does not match the run; the message names its key."""


def parse_header(prefix: bytes | memoryview, key: str) -> Header:
    """Parse a batch object's header from its first bytes (all of the header must be there)."""
    try:
        return parse_batch_header(prefix, key, outputs=True)
    except BatchFileError as exc:
        raise CorruptBatch(str(exc)) from None


def check_against_run(header: Header, manifest: Manifest) -> None:
    """The object must carry the run's layers, dtype, store dtype and hidden size."""
    problems, layer_ids = [], tuple(manifest.layer_ids)
    if not isinstance(header.meta, BatchMeta):
        raise CorruptBatch(f"{header.key}: is a batch's inputs ({header.metadata['format']}), not its hidden states")
    if header.meta.layer_ids not in (None, layer_ids):
        problems.append(f"layer_ids {list(header.meta.layer_ids)} != run's {list(layer_ids)}")
    dtype, shape = header.stored("hidden_states")
    if len(shape) != 2 or shape[1] != manifest.width:
        problems.append(f"hidden_states shape {list(shape)}, run wants [N, {manifest.width}]")
    stored_name = FP8 if dtype == torch.float8_e4m3fn else dtype_name(dtype)
    if stored_name != manifest.store_dtype:
        problems.append(f"hidden_states stored as {stored_name}, run's store dtype is {manifest.store_dtype}")
    if manifest.store_final and not header.has("final_hidden_states"):
        problems.append("final_hidden_states missing")
    if problems:
        raise CorruptBatch(f"{header.key}: does not match the run's manifest: " + "; ".join(problems))


def decode(buf: torch.Tensor, key: str, manifest: Manifest | None = None) -> BatchContents:
    """Decode a whole batch object held in a uint8 tensor (see hsx.batch.batchfile.decode_batch)."""
    header = parse_header(memoryview(buf.numpy())[:min(len(buf), MAX_HEADER + 8)], key)
    if manifest is not None:
        check_against_run(header, manifest)
    try:
        return decode_batch(buf, key, outputs=True)
    except BatchFileError as exc:
        raise CorruptBatch(str(exc)) from None


def fetch_object(store: Store, key: str) -> torch.Tensor:
    """The whole object as a writable uint8 tensor that owns its bytes.

    A local file is read once into memory (one copy from the page cache), never mapped: what a caller checks
    and decodes is then what it keeps, whatever a foreign writer does to the file afterwards (a copy-on-write
    mapping shows such a rewrite through every page not yet written to). A remote object is read into memory.
    """
    if isinstance(store, LocalStore):
        try:
            path = store.path(key)  # a key from the index may not leave the store (`..`, symlinks)
        except ValueError as exc:
            raise ReaderError(f"{store.url()}: {exc}") from None
        try:
            with open(path, "rb", buffering=0) as fh:
                return _read_whole(fh)
        except FileNotFoundError:
            raise ReaderError(f"{store.url(key)}: batch object is missing from the store") from None
    try:
        data = store.get_bytes(key)
    except ObjectNotFound:
        raise ReaderError(f"{store.url(key)}: batch object is missing from the store") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _read_whole(fh) -> torch.Tensor:
    """The file's bytes as fstat sized them, in one tensor (shorter if the file shrank meanwhile: the size
    check then names it truncated)."""
    size = os.fstat(fh.fileno()).st_size
    buf = torch.empty(size, dtype=torch.uint8)
    view, got = memoryview(buf.numpy()), 0
    while got < size:
        n = fh.readinto(view[got:])
        if not n:
            return buf[:got].clone()
        got += n
    return buf


def check_digest(buf: torch.Tensor, where: str, size: int, sha256: str) -> torch.Tensor:
    """``buf`` if it has the size and SHA-256 the run's index recorded for it; else CorruptBatch."""
    if buf.numel() != size:
        raise CorruptBatch(f"{where}: object is {buf.numel()} bytes, the index recorded {size} "
                           f"({'truncated' if buf.numel() < size else 'trailing bytes'})")
    got = hashlib.sha256(memoryview(buf.numpy()) if buf.numel() else b"").hexdigest()
    if got != sha256:
        raise CorruptBatch(f"{where}: object's SHA-256 differs from the one the index recorded "
                           "(corrupt or changed at rest; `hsx verify --run R --repair` re-extracts it)")
    return buf


def fetch_header(store: Store, key: str) -> Header:
    """Read only the header (one or two range requests)."""
    try:
        return read_header(lambda start, length: store.get_bytes(key, start, length), key)
    except ObjectNotFound:
        raise ReaderError(f"{store.url(key)}: batch object is missing from the store") from None
    except BatchFileError as exc:
        raise CorruptBatch(str(exc)) from None


_SCALES = {"hidden_states": "hidden_scales", "final_hidden_states": "final_scales"}


def fetch_rows(store: Store, header: Header, names: list[str], lo: int, hi: int,
               check_row: int | None = None) -> dict[str, torch.Tensor]:
    """Rows ``lo:hi`` of the named [N, ...] tensors, each by one range request of its exact bytes.

    FP8 hidden states come back dequantised (their scales' rows are fetched too). A compressed tensor
    cannot be read by range: ask ``ranged(header)`` first and read such an object whole. ``check_row``: the
    rows are sample ``check_row``'s and ``names`` hold every hidden-state tensor of the object: its stored
    hidden rows are checked against the CRC-32 its header recorded for that sample, where it has them
    (``sample_hidden_crc32``; CorruptBatch if they differ), before any is dequantised.
    """
    stored = {}
    for name in names:
        if name in header.encoding:
            raise ReaderError(f"{header.key}: {name} is compressed ({header.encoding[name]['codec']}); read it whole")
        stored[name] = _rows(store, header, name, lo, hi)
        scale_name = _SCALES.get(name)
        if scale_name in header.tensors:
            stored[scale_name] = _rows(store, header, scale_name, lo, hi)
    if check_row is not None and header.meta.sample_hidden_crc32 is not None:
        check_sample_hidden(store, header, check_row, stored)
    out = {name: stored[name] for name in names}
    for name in names:
        if _SCALES.get(name) and out[name].dtype == torch.float8_e4m3fn:
            try:
                out[name] = stored_values(header, name, out[name], stored.get(_SCALES[name]))
            except BatchFileError as exc:
                raise CorruptBatch(str(exc)) from None
    return out


def check_sample_hidden(store: Store, header: Header, row: int, stored: dict[str, torch.Tensor]) -> None:
    """CorruptBatch unless sample ``row``'s hidden rows as stored (``stored``: its rows of every one of
    HIDDEN_ROWS the object holds) have the CRC-32 its header recorded for that sample (hsx/batch/hidden.py)."""
    missing = [name for name in HIDDEN_ROWS if name in header.tensors and name not in stored]
    if missing:
        raise ValueError(f"{header.key}: sample {row}'s hidden rows are checked whole; {missing} were not read")
    if sample_rows_crc32(stored) != header.meta.sample_hidden_crc(row):
        raise CorruptBatch(f"{store.url(header.key)}: sample {header.meta.sample_ids[row]!r:.80} (row {row}): its "
                           "hidden-state rows' CRC-32 differs from the one its header recorded (changed at rest; "
                           f"`hsx verify --run {header.meta.run or 'R'} --repair` re-extracts it)")


def ranged(header: Header) -> bool:
    """True when a sample can be read by byte ranges (no tensor of the object is compressed)."""
    return not header.encoding


def _rows(store: Store, header: Header, name: str, lo: int, hi: int) -> torch.Tensor:
    spec = header.tensors[name]
    start, end = spec.start + lo * spec.row_bytes, spec.start + hi * spec.row_bytes
    data = store.get_bytes(header.key, start, end)
    if len(data) != end - start:
        raise CorruptBatch(f"{header.key}: asked for bytes {start}..{end} of {name}, got {len(data)} "
                           "(object truncated?)")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return buf.view(spec.dtype).reshape((hi - lo,) + spec.shape[1:])


def fetch_token_columns(store: Store, header: Header) -> dict[str, torch.Tensor] | None:
    """``cu_seqlens``, ``input_ids`` and ``loss_mask`` of the whole batch, each by one range request, checked
    against the token digest its header carries (CorruptBatch if they differ). None when the object has no
    such digest (written before it was recorded): read the whole object then, digest-checked."""
    if header.meta.token_sha256 is None:
        return None
    n = header.tensors["cu_seqlens"].shape[0]
    cu = fetch_rows(store, header, ["cu_seqlens"], 0, n)["cu_seqlens"]
    tokens = int(cu[-1]) if n else 0
    columns = {"cu_seqlens": cu, **fetch_rows(store, header, ["input_ids", "loss_mask"], 0, tokens)}
    if columns_digest(columns) != header.meta.token_sha256:
        raise CorruptBatch(f"{store.url(header.key)}: token columns' SHA-256 differs from the one its header "
                           f"recorded (changed at rest; `hsx verify --run {header.meta.run or 'R'} --repair` "
                           "re-extracts it)")
    return columns


def check_sample_tokens(store: Store, header: Header, row: int, rows: dict[str, torch.Tensor]) -> None:
    """CorruptBatch unless sample ``row``'s token rows as read by range (``rows``: its two ``cu_seqlens`` rows,
    its ``input_ids`` and ``loss_mask`` rows) have the digest its header recorded for that sample
    (``sample_token_sha256``, hsx/batch/tokens.py; the caller checks the header has them)."""
    got = sample_token_digest(rows["cu_seqlens"], rows["input_ids"], rows["loss_mask"])
    if got != header.meta.sample_digest(row):
        raise CorruptBatch(f"{store.url(header.key)}: sample {header.meta.sample_ids[row]!r:.80} (row {row}): its "
                           "token rows' SHA-256 differs from the one its header recorded (changed at rest; "
                           f"`hsx verify --run {header.meta.run or 'R'} --repair` re-extracts it)")
