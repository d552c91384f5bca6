"""Issue 28 item 2: the upload hot path's passes over the bytes (what each costs: docs/benchmarks.md).

On moto's S3 server, through boto3's own request events: each request body is the reused part buffer
(no copy into a BytesIO), at most PART_CONCURRENCY + 1 buffers serve a whole multipart upload, SigV4
signs UNSIGNED-PAYLOAD (no SHA-256 of each body) and no CRC32 rides on top of Content-MD5, which
every upload still carries and the object still verifies against. hsx/store/parts.py reads each byte
once and refuses a file of another size than its job says.
"""

from __future__ import annotations

import hashlib
import io
import os

import pytest

from hsx.store import VerifyError
from hsx.store.parts import BufferPool, ShortFile, read_parts
from hsx.store.s3 import PART_CONCURRENCY, S3Settings, S3Store

MiB = 2**20


def _store(endpoint, bucket):
    return S3Store(S3Settings(bucket=bucket, prefix="hot", endpoint_url=endpoint, region="us-east-1",
                              addressing_style="path", attempts=2, multipart_threshold=5 * MiB,
                              multipart_chunk=5 * MiB))


def _record_requests(store) -> list:
    """(operation, headers, body) of every request the store's client sends, bodies held (their ids stay theirs)."""
    sent = []
    for operation in ("PutObject", "UploadPart"):
        store.client.meta.events.register(f"before-send.s3.{operation}", lambda request, op=operation, **_: sent.append(
            (op, dict(request.headers), request.body)))
    return sent


def test_parts_are_reused_buffers_sent_unsigned_with_content_md5_only(s3_server, s3_bucket, tmp_path):
    store = _store(s3_server, s3_bucket)
    sent = _record_requests(store)
    data = os.urandom(12 * 5 * MiB + 77)  # 13 parts
    path = tmp_path / "b.safetensors"
    path.write_bytes(data)
    store.put_file("run/b.safetensors", path, len(data), hashlib.sha256(data).hexdigest())

    parts = [(headers, body) for op, headers, body in sent if op == "UploadPart"]
    assert len(parts) == 13
    assert all(isinstance(body, bytearray) for _, body in parts), "a part body was copied out of its buffer"
    assert len({id(body) for _, body in parts}) <= PART_CONCURRENCY + 1 + 1  # the pool's buffers + the short last
    for headers, _ in parts:
        assert "UNSIGNED-PAYLOAD" in str(headers["X-Amz-Content-SHA256"])
        assert not any(k.lower().startswith("x-amz-checksum-") or k.lower() == "x-amz-sdk-checksum-algorithm"
                       for k in headers), sorted(headers)
        assert "Content-MD5" in headers
    assert store.get_bytes("run/b.safetensors") == data


def test_a_single_put_is_read_once_and_sent_unsigned_with_content_md5(s3_server, s3_bucket, tmp_path):
    store = _store(s3_server, s3_bucket)
    sent = _record_requests(store)
    data = os.urandom(3 * MiB + 5)
    path = tmp_path / "small.safetensors"
    path.write_bytes(data)
    info = store.put_file("run/small.safetensors", path, len(data), hashlib.sha256(data).hexdigest())
    [(headers, body)] = [(h, b) for op, h, b in sent if op == "PutObject"]
    assert isinstance(body, bytearray) and bytes(body) == data
    assert headers["Content-MD5"] and "UNSIGNED-PAYLOAD" in str(headers["X-Amz-Content-SHA256"])
    assert info.size == len(data) and store.get_bytes("run/small.safetensors") == data


@pytest.mark.parametrize("actual", [10 * MiB - 1, 10 * MiB + 1])
def test_a_file_of_another_size_than_its_job_is_refused(s3_server, s3_bucket, tmp_path, actual):
    store = _store(s3_server, s3_bucket)
    path = tmp_path / "b.safetensors"
    data = os.urandom(actual)
    path.write_bytes(data)
    with pytest.raises(VerifyError, match="expected"):
        store.put_file("run/odd.safetensors", path, 10 * MiB, hashlib.sha256(data[:10 * MiB]).hexdigest())
    assert store.head("run/odd.safetensors") is None


class _CountingFile(io.BytesIO):
    def __init__(self, data: bytes):
        super().__init__(data)
        self.delivered = 0

    def readinto(self, buffer) -> int:
        got = super().readinto(buffer)
        self.delivered += got
        return got


def test_read_parts_reads_each_byte_once_and_feeds_every_digest():
    data = os.urandom(3 * MiB + 12345)
    fh = _CountingFile(data)
    sha, whole_md5, pool = hashlib.sha256(), hashlib.md5(), BufferPool(keep=2)
    parts = []
    for part in read_parts(fh, len(data), MiB, pool, (sha, whole_md5)):
        parts.append((part.number, bytes(part.body), part.md5))
        pool.give(part.body)
    assert fh.delivered == len(data)
    assert b"".join(body for _, body, _ in parts) == data and [n for n, _, _ in parts] == [1, 2, 3, 4]
    assert all(md5 == hashlib.md5(body).digest() for _, body, md5 in parts)
    assert sha.digest() == hashlib.sha256(data).digest() and whole_md5.digest() == hashlib.md5(data).digest()
    # without part MD5s (a whole-object MD5 check): no part digest
    assert all(p.md5 is None for p in read_parts(io.BytesIO(data), len(data), MiB, pool, (), part_md5=False))


def test_the_pool_reuses_buffers_of_its_size_and_keeps_at_most_keep():
    pool = BufferPool(keep=2)
    a, b, c = pool.take(64), pool.take(64), pool.take(64)
    for buffer in (a, b, c):
        pool.give(buffer)
    again = {id(pool.take(64)), id(pool.take(64))}
    assert again <= {id(a), id(b), id(c)} and len(again) == 2
    assert id(pool.take(64)) not in {id(a), id(b), id(c)}  # only two were kept: the third take is a new one
    with pytest.raises(ShortFile):
        list(read_parts(io.BytesIO(b"abc"), 4, 2, pool, ()))
