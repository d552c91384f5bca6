"""Reading a spool file for upload: each byte read once, into reused part buffers, hashed while in cache.

The uploader's CPU per GiB is its cost: an 8-GPU host spools ~4 GiB/s. Per part:

    file --readinto HASH_BLOCK--> part buffer (bytearray from the pool, handed to botocore as the body)
                                     |-> the file's SHA-256 (checked against the worker's before completing)
                                     |-> the part's MD5 (its Content-MD5, and the multipart ETag composite)
                                     '-> or, in crc32 integrity mode (quirks.py), the part's CRC32 instead of any MD5

- One read of each byte, straight into the buffer the request sends (a bytearray: botocore and urllib3 pass
  it to ``sendall`` without a copy; ``bytes`` would be wrapped in a BytesIO and copied 16 KiB at a time).
- Both hashes take each HASH_BLOCK while it is in the CPU cache, not after the whole part left it.
- Buffers are reused (``BufferPool``): a fresh 64 MiB ``bytes`` per part costs ~0.5 s per GiB in page faults
  (measured on the 2-core box: as much as the SHA-256). The pool keeps at most ``keep`` full-size buffers
  (PART_CONCURRENCY + 1 for one upload; one pool a process, ``s3.PART_BUFFERS``, whatever the number of runs'
  stores), so an uploader process holds (PART_CONCURRENCY + 1) x part size once it has uploaded a large file.
  A file's last, shorter part gets a buffer of its own length (not kept).
"""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

HASH_BLOCK = 2**20  # bytes read and hashed at a time: fits a core's L2 cache


class BufferPool:
    """Reusable bytearrays of one size (the part size); thread-safe."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            while self._free:
                buffer = self._free.pop()
                if len(buffer) == size:
                    return buffer
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        with self._lock:
            if len(self._free) < self.keep and all(len(b) == len(buffer) for b in self._free):
                self._free.append(buffer)


@dataclass
class Part:
    number: int          # 1-based part number
    body: bytearray      # exactly the part's bytes; give it back to the pool once sent
    md5: bytes | None    # MD5 digest of body (None: not asked for)
    crc32: int | None = None  # zlib.crc32 of body (None: not asked for)


class ShortFile(Exception):
    """The file ended before (or went on after) the size the upload job gave."""


def read_parts(fh: BinaryIO, size: int, part_size: int, pool: BufferPool, file_digests: tuple,
               part_md5: bool = True, part_crc32: bool = False) -> Iterator[Part]:
    """The ``size`` bytes of ``fh`` as parts of ``part_size`` (the last one shorter), each byte read once and fed
    to every one of ``file_digests`` (hashlib objects over the whole file: its SHA-256, a whole-object MD5) and,
    with ``part_md5``, to its part's MD5, with ``part_crc32`` to its part's CRC32 (zlib.crc32 releases the GIL on
    each block, as hashlib does). ShortFile if ``fh`` holds another size."""
    number, offset = 0, 0
    while offset < size:
        length = min(part_size, size - offset)
        body = pool.take(length)
        view, filled, crc = memoryview(body), 0, 0
        digests = (*file_digests, hashlib.md5()) if part_md5 else file_digests
        while filled < length:
            got = fh.readinto(view[filled:filled + HASH_BLOCK])
            if not got:
                pool.give(body)
                raise ShortFile(f"the file ended at {offset + filled} bytes, expected {size}")
            block = view[filled:filled + got]
            for digest in digests:
                digest.update(block)
            if part_crc32:
                crc = zlib.crc32(block, crc)
            filled += got
        number += 1
        offset += length
        yield Part(number, body, digests[-1].digest() if part_md5 else None, crc if part_crc32 else None)
    if fh.read(1):
        raise ShortFile(f"the file is longer than the {size} bytes expected")
