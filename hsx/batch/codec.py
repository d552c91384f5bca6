"""Lossless codecs of a batch file's hidden states, run on the writer threads (never the GPU thread).

``zstd``: the tensor's bytes are first split into byte planes (plane k holds byte
k, little-endian, of every element: for bf16 plane 0 holds the mantissa bytes,
plane 1 sign + exponent), then each plane is one zstd frame, or stored raw when
a probe of its first PROBE_BYTES does not compress below RAW_ABOVE (the
mantissa plane is close to random: compressing it costs CPU and saves ~nothing).
The stored bytes are the planes' frames back to back; the batch header's
``encoding`` lists each plane as [codec, bytes]. An FP8 tensor has one plane.

Measured on the H200 run (docs/benchmarks.md): one zstd frame over both bf16 planes cost
4.1 writer-seconds a GB and held the GPU to 0.30 of bare; compressing the exponent
plane alone gives the same ratio for a fraction of the CPU.
"""

from __future__ import annotations

import torch

from hsx.defaults import CODECS

ZSTD_LEVEL = 1          # levels 1-3 measured within a few % of each other in ratio; 1 is the cheapest
ZSTD_THREADS = 4        # zstd worker threads a compression (each writer thread compresses one batch)
# Ratio (stored / raw bytes of a token) assumed for estimates before a run has measured its own, by codec and
# store dtype: measured on an H200 run of a Qwen3-8B shape (docs/benchmarks.md): zstd 28,189 / 40,965
# for bf16, 16,798 / 20,505 for FP8. Real weights may differ.
ESTIMATED_RATIO = {"none": 1.0, "zstd": 0.69}
ESTIMATED_RATIO_FP8 = {"none": 1.0, "zstd": 0.82}
PROBE_BYTES = 1 << 20   # bytes of a plane compressed first to decide whether the plane is worth it
RAW_ABOVE = 0.95        # a plane whose probe compresses to more than this share of its size is stored raw


class _Stats:
    """Seconds spent compressing and bytes in/out, this process (for benchmarks and the worker's stats)."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.seconds = 0.0
        self.raw_bytes = self.stored_bytes = 0

    def add(self, seconds: float, raw: int, stored: int) -> None:
        with self.lock:
            self.seconds += seconds
            self.raw_bytes += raw
            self.stored_bytes += stored


STATS = _Stats()


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise ValueError(f"codec {name!r}: use one of {', '.join(CODECS)}")
    return name


def _zstd():
    try:
        import zstandard
    except ImportError:
        raise RuntimeError("codec zstd needs the `zstandard` package (pip install zstandard)") from None
    return zstandard


def split_planes(t: torch.Tensor) -> list[torch.Tensor]:
    """A contiguous tensor's bytes as byte planes (uint8 tensors, plane k = byte k of every element)."""
    size = t.element_size()
    flat = t.reshape(-1)
    if size == 1:
        return [flat.view(torch.uint8)]
    if size == 2:  # two elementwise ops; much cheaper than a strided transpose
        v = flat.view(torch.int16)
        return [(v & 0xFF).to(torch.uint8), ((v >> 8) & 0xFF).to(torch.uint8)]
    raw = flat.view(torch.uint8).view(-1, size).t()
    return [raw[k].contiguous() for k in range(size)]


def join_planes(planes: list[torch.Tensor], dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    size = len(planes)
    if size == 1:
        out = planes[0]
    elif size == 2:
        out = (planes[0].to(torch.int16) | (planes[1].to(torch.int16) << 8)).view(torch.uint8)
    else:
        out = torch.stack(planes, dim=1).reshape(-1)
    return out.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(b"")


def encode(t: torch.Tensor, codec: str) -> tuple[torch.Tensor, list[list]]:
    """(the tensor's stored bytes under ``codec`` as a uint8 tensor, its planes as [[codec, bytes], ...])."""
    if codec == "none":
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        return raw, [["raw", raw.numel()]]
    import time

    z = _zstd()
    started = time.perf_counter()
    compressor = z.ZstdCompressor(level=ZSTD_LEVEL, threads=ZSTD_THREADS)
    probe = z.ZstdCompressor(level=ZSTD_LEVEL)
    parts, planes = [], []
    for plane in split_planes(t.contiguous()):
        data = _bytes(plane)
        head = data[:PROBE_BYTES]
        if len(head) and len(probe.compress(head)) > RAW_ABOVE * len(head):
            parts.append(data)
            planes.append(["raw", len(data)])
        else:
            packed = compressor.compress(data)
            parts.append(packed)
            planes.append(["zstd", len(packed)])
    out = torch.empty(sum(n for _, n in planes), dtype=torch.uint8)
    offset = 0
    for part in parts:
        out[offset:offset + len(part)] = torch.frombuffer(bytearray(part) if isinstance(part, bytes) else part,
                                                          dtype=torch.uint8) if len(part) else out[:0]
        offset += len(part)
    STATS.add(time.perf_counter() - started, t.numel() * t.element_size(), out.numel())
    return out, planes


def decode(data: torch.Tensor | bytes | memoryview, codec: str, dtype: torch.dtype, shape: tuple[int, ...],
           planes: list[list] | None = None) -> torch.Tensor:
    """Inverse of ``encode``; raises ValueError on a corrupt frame or sizes that do not fit ``shape``."""
    raw = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)
    if codec == "none":
        raise ValueError("codec none stores tensors as they are; nothing to decode")
    numel = 1
    for d in shape:
        numel *= d
    size = torch.empty((), dtype=dtype).element_size()
    planes = planes or [["zstd", len(raw)]]
    if len(planes) not in (1, size) or sum(int(n) for _, n in planes) != len(raw):
        raise ValueError(f"plane table {planes} does not fit {len(raw)} stored bytes of {size}-byte elements")
    z = _zstd()
    want = numel * size // len(planes)
    out, offset = [], 0
    for plane_codec, nbytes in planes:
        chunk = raw[offset:offset + int(nbytes)]
        offset += int(nbytes)
        if plane_codec == "raw":
            plain = chunk
        elif plane_codec == "zstd":
            try:
                plain = z.ZstdDecompressor().decompress(chunk, max_output_size=want)
            except z.ZstdError as exc:
                raise ValueError(f"zstd frame does not decode ({exc})") from None
        else:
            raise ValueError(f"unknown plane codec {plane_codec!r}")
        if len(plain) != want:
            raise ValueError(f"a plane holds {len(plain)} bytes, the header's shape {list(shape)} wants {want}")
        out.append(torch.frombuffer(bytearray(plain), dtype=torch.uint8) if want else torch.empty(0, dtype=torch.uint8))
    if len(planes) == 1 and size > 1:  # one frame of all planes (not written any more; kept readable)
        out = list(out[0].view(size, -1))
    return join_planes(out, dtype, shape)
