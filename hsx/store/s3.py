"""An S3 (or S3-compatible) store.

Credentials come only from boto3's standard chain (environment, shared config,
instance role); nothing here accepts or logs them.

Verification of an upload, before anyone may record it done:
- each request carries Content-MD5, so the server rejects a corrupted body;
- the object's ContentLength equals the file size;
- the object's ETag equals the MD5 (single part) or the multipart MD5
  composite ``md5(md5(part1)..md5(partN))-N`` computed from the bytes read;
- the object's ``sha256`` metadata equals the file's SHA-256, which the
  uploader recomputed from the bytes it sent.
Stores whose ETag is not an MD5 (e.g. SSE-KMS) can turn the ETag check off
(``verify_etag=False``); size + SHA-256 metadata + Content-MD5 remain.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from hsx.defaults import DEFAULT_MULTIPART_CHUNK, DEFAULT_MULTIPART_THRESHOLD, DEFAULT_UPLOAD_RETRIES
from hsx.retry import retry_call
from hsx.store.base import ObjectInfo, PermanentStoreError, Store, StoreError, VerifyError, check_read_back
from hsx.store.parts import BufferPool, Part, ShortFile, read_parts

log = logging.getLogger(__name__)
RETRYABLE = (BotoCoreError, ClientError, ConnectionError, TimeoutError)
NOT_FOUND = ("404", "NoSuchKey", "NotFound")
# Answers no retry can change (issue 23 item 4): failed fast with the store's message, counted against the batch.
PERMANENT = ("403", "AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId", "InvalidBucketName",
             "NoSuchBucket", "NotSignedUp", "SignatureDoesNotMatch", "InvalidObjectState")


class _Missing(Exception):
    """A 404: an answer, not a fault; never retried."""
PART_CONCURRENCY = 4  # parts of one object in flight at once (memory: x chunk bytes)
READ_BACK_CHUNK = 8 * 2**20  # bytes hashed at a time by read_back
# Part buffers of this process, reused across uploads and stores (one upload in flight holds PART_CONCURRENCY + 1).
PART_BUFFERS = BufferPool(keep=PART_CONCURRENCY + 1)


@dataclass(frozen=True)
class S3Settings:
    bucket: str
    prefix: str
    endpoint_url: str | None = None      # any S3-compatible endpoint; None = AWS
    region: str | None = None
    addressing_style: str = "auto"       # auto | path | virtual
    verify_etag: bool = True
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD  # bytes
    multipart_chunk: int = DEFAULT_MULTIPART_CHUNK          # bytes
    attempts: int = DEFAULT_UPLOAD_RETRIES                  # tries of each call


def _meta_sha256(info: dict) -> str | None:
    """The object's ``sha256`` user metadata, its key in any case: HTTP header names are case-insensitive and some
    servers (rclone serve s3) answer ``x-amz-meta-Sha256``, which boto3 hands back as ``Sha256``."""
    return next((v for k, v in info.get("Metadata", {}).items() if k.lower() == "sha256"), None)


def _read_single(path: Path, size: int, sha256: str) -> Part:
    """The whole file as one part (a single PUT), read once; VerifyError unless it is ``size`` bytes of ``sha256``."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        try:
            parts = list(read_parts(fh, size, max(size, 1), BufferPool(keep=0), (digest,)))
        except ShortFile as exc:
            raise VerifyError(f"{path}: local file is not the {size} bytes expected: {exc}") from None
    if digest.hexdigest() != sha256:
        raise VerifyError(f"{path}: local file is {size} bytes sha256 {digest.hexdigest()[:12]}, "
                          f"expected {size} bytes sha256 {sha256[:12]}")
    return parts[0] if parts else Part(1, bytearray(), hashlib.md5(b"").digest())


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class S3Store(Store):
    def __init__(self, settings: S3Settings):
        self.s = settings
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region,
            # payload_signing_enabled False: SigV4 signs UNSIGNED-PAYLOAD instead of a SHA-256 of every body
            # (botocore already does so over https when Content-MD5 is sent; over http it hashed every byte again,
            # ~0.6 s a GiB). The body stays covered: its Content-MD5 is a signed header and the server checks it.
            # request_checksum_calculation "when_required": no CRC32 of every body on top of Content-MD5 (botocore
            # >= 1.36 adds one by default, ~0.2 s a GiB; some S3-compatible servers refuse it).
            config=Config(s3={"addressing_style": settings.addressing_style, "payload_signing_enabled": False},
                          request_checksum_calculation="when_required",
                          retries={"max_attempts": 5, "mode": "adaptive"},
                          max_pool_connections=2 * PART_CONCURRENCY + 2))
        self._buffers = PART_BUFFERS

    def _k(self, key: str) -> str:
        return f"{self.s.prefix.strip('/')}/{key}" if self.s.prefix.strip("/") else key

    def url(self, key: str = "") -> str:
        return f"s3://{self.s.bucket}/{self._k(key)}"

    def _call(self, what: str, fn):
        def once():
            try:
                return fn()
            except ClientError as exc:
                error = exc.response.get("Error", {})
                if error.get("Code") in NOT_FOUND:
                    raise _Missing(what) from exc
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if error.get("Code") in PERMANENT or status == 403:
                    raise PermanentStoreError(f"{what}: the store answered {error.get('Code') or status}: "
                                              f"{error.get('Message') or exc}") from None
                raise

        try:
            return retry_call(once, what, RETRYABLE, self.s.attempts)
        except RETRYABLE as exc:
            raise StoreError(f"{what}: {exc}") from exc

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        sha = hashlib.sha256(data).hexdigest()
        self._call(f"put {self.url(key)}", lambda: self.client.put_object(
            Bucket=self.s.bucket, Key=self._k(key), Body=data, ContentMD5=_md5_b64(data), Metadata={"sha256": sha}))
        return self._verify(key, len(data), sha, f'"{hashlib.md5(data).hexdigest()}"')

    def put_file(self, key: str, path: Path, size: int, sha256: str) -> ObjectInfo:
        """Upload the file, each byte read once (hsx/store/parts.py), and verify it; the file's SHA-256 is
        recomputed from the bytes sent and must equal ``sha256`` (the worker's) before the upload completes."""
        if size < self.s.multipart_threshold:
            part = _read_single(Path(path), size, sha256)
            self._call(f"put {self.url(key)}", lambda: self.client.put_object(
                Bucket=self.s.bucket, Key=self._k(key), Body=part.body, ContentMD5=base64.b64encode(part.md5).decode(),
                Metadata={"sha256": sha256}))
            return self._verify(key, size, sha256, f'"{part.md5.hex()}"')
        return self._put_multipart(key, Path(path), size, sha256)

    def _put_multipart(self, key: str, path: Path, size: int, sha256: str) -> ObjectInfo:
        k = self._k(key)
        upload_id = self._call(f"start multipart {self.url(key)}", lambda: self.client.create_multipart_upload(
            Bucket=self.s.bucket, Key=k, Metadata={"sha256": sha256}))["UploadId"]
        try:
            digest, part_md5s, futures = hashlib.sha256(), [], []
            with ThreadPoolExecutor(PART_CONCURRENCY) as pool, open(path, "rb", buffering=0) as fh:
                try:
                    for part in read_parts(fh, size, self.s.multipart_chunk, self._buffers, (digest,)):
                        part_md5s.append(part.md5)
                        if len(futures) >= PART_CONCURRENCY:  # bound memory: wait for the oldest part
                            futures[-PART_CONCURRENCY].result()
                        futures.append(pool.submit(self._upload_part, k, upload_id, part))
                except ShortFile as exc:
                    raise VerifyError(f"{path}: local file changed or is corrupt: {exc}") from None
                parts = [f.result() for f in futures]
            if digest.hexdigest() != sha256:
                raise VerifyError(f"{path}: local file changed or is corrupt (sha256 {digest.hexdigest()[:12]}, expected {sha256[:12]})")
            self._call(f"complete multipart {self.url(key)}", lambda: self.client.complete_multipart_upload(
                Bucket=self.s.bucket, Key=k, UploadId=upload_id, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.s.bucket, Key=k, UploadId=upload_id)
            except Exception as exc:  # the store's lifecycle rule reaps it otherwise
                log.warning("could not abort multipart upload of %s: %s", self.url(key), exc)
            raise
        etag = f'"{hashlib.md5(b"".join(part_md5s)).hexdigest()}-{len(part_md5s)}"'
        return self._verify(key, size, sha256, etag)

    def _upload_part(self, k: str, upload_id: str, part: Part) -> dict:
        """Send one part (its buffer goes back to the pool once the part is in, or has failed for good)."""
        try:
            r = self._call(f"upload part {part.number} of s3://{self.s.bucket}/{k}", lambda: self.client.upload_part(
                Bucket=self.s.bucket, Key=k, UploadId=upload_id, PartNumber=part.number, Body=part.body,
                ContentMD5=base64.b64encode(part.md5).decode()))
        finally:
            self._buffers.give(part.body)
        return {"ETag": r["ETag"], "PartNumber": part.number}

    def _verify(self, key: str, size: int, sha256: str, etag: str) -> ObjectInfo:
        info = self._call(f"head {self.url(key)}", lambda: self.client.head_object(Bucket=self.s.bucket, Key=self._k(key)))
        if not _meta_sha256(info):
            raise PermanentStoreError(f"{self.url(key)}: the store kept no sha256 metadata (x-amz-meta-sha256) on the "
                                      "object hsx wrote with it, so it can never be verified; this store drops user "
                                      "metadata and cannot hold an hsx run")
        problems = []
        if info["ContentLength"] != size:
            problems.append(f"size {info['ContentLength']} != {size}")
        if _meta_sha256(info) != sha256:
            problems.append(f"sha256 metadata {_meta_sha256(info)!r} != {sha256!r}")
        if self.s.verify_etag and info.get("ETag") != etag:
            problems.append(f"ETag {info.get('ETag')} != {etag}")
        if problems:
            raise VerifyError(f"{self.url(key)} failed verification: {'; '.join(problems)}")
        return ObjectInfo(key, size, sha256)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            info = self._call(f"head {self.url(key)}", lambda: self.client.head_object(Bucket=self.s.bucket, Key=self._k(key)))
        except _Missing:
            return None
        return ObjectInfo(key, info["ContentLength"], _meta_sha256(info))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        kwargs = {"Bucket": self.s.bucket, "Key": self._k(key)}
        if start is not None or end is not None:
            kwargs["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        try:
            return self._call(f"get {self.url(key)}", lambda: self.client.get_object(**kwargs)["Body"].read())
        except _Missing:
            raise KeyError(self.url(key)) from None

    def read_back(self, key: str, size: int, sha256: str) -> None:
        """Stream the object (READ_BACK_CHUNK bytes at a time) and check size and SHA-256."""
        def read() -> tuple[int, str]:
            digest, got = hashlib.sha256(), 0
            body = self.client.get_object(Bucket=self.s.bucket, Key=self._k(key))["Body"]
            for chunk in body.iter_chunks(READ_BACK_CHUNK):
                digest.update(chunk)
                got += len(chunk)
            return got, digest.hexdigest()

        try:
            got_size, got_sha = self._call(f"read back {self.url(key)}", read)
        except _Missing:
            raise VerifyError(f"{self.url(key)}: read back after upload: the object is missing "
                              "(the store's HEAD said it was there)") from None
        check_read_back(self.url(key), got_size, got_sha, size, sha256)

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """(key, upload id, age in s on the store's clock) of each multipart upload under ``prefix`` that
        was started and neither completed nor aborted (a killed uploader's: its parts are billed storage)."""
        found = []
        for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.s.bucket,
                                                                                  Prefix=self._k(prefix)):
            now = parsedate_to_datetime(page["ResponseMetadata"]["HTTPHeaders"]["date"])
            now = now if now.tzinfo else now.replace(tzinfo=timezone.utc)  # HTTP dates are GMT
            strip = len(self._k(""))
            found.extend((u["Key"][strip:], u["UploadId"], (now - u["Initiated"]).total_seconds())
                         for u in page.get("Uploads", []))
        return found

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort an incomplete multipart upload (its parts are deleted); one already gone is no error."""
        def abort():
            try:
                self.client.abort_multipart_upload(Bucket=self.s.bucket, Key=self._k(key), UploadId=upload_id)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                    raise

        try:
            self._call(f"abort multipart {self.url(key)}", abort)
        except _Missing:
            pass

    def list_keys(self, prefix: str) -> list[str]:
        strip = len(self._k(""))
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.s.bucket, Prefix=self._k(prefix)):
            keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._call(f"delete {self.url(key)}", lambda: self.client.delete_object(Bucket=self.s.bucket, Key=self._k(key)))
