"""An S3 (or S3-compatible) store.

Credentials come only from boto3's standard chain (environment, shared config,
instance role); nothing here accepts or logs them.

Verification of an upload, before anyone may record it done (and the spool file be deleted):
- each request carries Content-MD5, so a server that checks it rejects a corrupted body;
- the object's ContentLength equals the file size;
- a single-part object's ETag equals the MD5 of the bytes read;
- a multipart object is checked the way that is real on this endpoint (hsx/store/quirks.py, learned by a
  probe and said in one start line): the composite ``md5(md5(part1)..md5(partN))-N`` (AWS, moto), the
  MD5 of the whole object (rclone), or a read-back of the object's SHA-256;
- the object's ``sha256`` metadata (read case-insensitively: rclone answers ``Sha256``) equals the
  file's SHA-256, which the uploader recomputed from the bytes it sent.
In crc32 integrity mode (quirks.integrity: probed where the server refuses a wrong CRC32, or set and so probed) every request
carries ``x-amz-checksum-crc32`` instead of Content-MD5, and the HEAD's ChecksumCRC32 (ChecksumMode ENABLED) must
equal the CRC32 of the bytes read (the composite ``crc32(crc32(part)..)-N`` for multipart) in place of the ETag
checks: no MD5 is computed. Size and the sha256 metadata are checked as in md5 mode.
Stores whose ETag is not an MD5 (e.g. SSE-KMS) turn the ETag check off (``verify_etag=False``):
single-part objects then rest on Content-MD5, multipart ones are read back.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from pathlib import Path

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from hsx.defaults import DEFAULT_MULTIPART_CHUNK, DEFAULT_MULTIPART_THRESHOLD, DEFAULT_UPLOAD_RETRIES
from hsx.retry import retry_call
from hsx.store.base import ObjectInfo, ObjectNotFound, PermanentStoreError, Store, StoreError, VerifyError, check_read_back
from hsx.store.parts import BufferPool, Part, ShortFile, read_parts
from hsx.store.probe import given_profile, probe
from hsx.store.quirks import (
    PROBE_PREFIX,
    EndpointProfile,
    EndpointQuirks,
    checks_line,
    composite_crc32,
    composite_etag,
    crc32_args,
    crc32_b64,
    crc32_matches,
    integrity,
    md5_etag,
    multipart_check,
)

log = logging.getLogger(__name__)
RETRYABLE = (BotoCoreError, ClientError, ConnectionError, TimeoutError)
NOT_FOUND = ("404", "NoSuchKey", "NotFound")
# Answers no retry can change: failed fast with the store's message, counted against the batch.
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
    quirks: EndpointQuirks = EndpointQuirks()  # checksum mode, addressing, multipart ETag style (quirks.py)
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD  # bytes
    multipart_chunk: int = DEFAULT_MULTIPART_CHUNK          # bytes
    attempts: int = DEFAULT_UPLOAD_RETRIES                  # tries of each call


def _read_single(path: Path, size: int, sha256: str, crc32: bool = False) -> Part:
    """The whole file as one part (a single PUT), read once, with its MD5 (or, ``crc32``, its CRC32 only);
    VerifyError unless it is ``size`` bytes of ``sha256``."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        try:
            parts = list(read_parts(fh, size, max(size, 1), BufferPool(keep=0), (digest,), part_md5=not crc32,
                                    part_crc32=crc32))
        except ShortFile as exc:
            raise VerifyError(f"{path}: local file is not the {size} bytes expected: {exc}") from None
    if digest.hexdigest() != sha256:
        raise VerifyError(f"{path}: local file is {size} bytes sha256 {digest.hexdigest()[:12]}, "
                          f"expected {size} bytes sha256 {sha256[:12]}")
    return parts[0] if parts else Part(1, bytearray(), None if crc32 else hashlib.md5(b"").digest(), 0 if crc32 else None)


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def _sha256_metadata(head: dict) -> str | None:
    """The object's ``sha256`` user metadata: HTTP header names are case-insensitive (rclone: ``Sha256``)."""
    return next((v for k, v in head.get("Metadata", {}).items() if k.lower() == "sha256"), None)


_PROFILES: dict[tuple, EndpointProfile] = {}  # (endpoint, bucket, quirks) -> what its probe learned, once a process
_PROFILES_LOCK = threading.Lock()


class S3Store(Store):
    def __init__(self, settings: S3Settings):
        self.s = settings
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region,
            # payload_signing_enabled False: SigV4 signs UNSIGNED-PAYLOAD instead of a SHA-256 of every body
            # (botocore already does so over https when Content-MD5 is sent; over http it hashed every byte again,
            # ~0.6 s a GiB). The body stays covered: its Content-MD5 is a signed header and the server checks it.
            # The checksum mode (default when_required: no CRC32 of every body on top of Content-MD5) is the
            # endpoint's quirk (hsx/store/quirks.py).
            config=settings.quirks.client_config(max_pool_connections=2 * PART_CONCURRENCY + 2))
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
                hint = self.s.quirks.refusal_hint(error.get("Code"), status)
                if hint:
                    raise PermanentStoreError(f"{what}: the store answered {error.get('Code') or status}: "
                                              f"{error.get('Message') or exc}; {hint}") from None
                raise

        try:
            return retry_call(once, what, RETRYABLE, self.s.attempts)
        except RETRYABLE as exc:
            raise StoreError(f"{what}: {exc}") from exc

    # ---- the endpoint's quirks (hsx/store/quirks.py) ---------------------------------------------
    def profile(self) -> EndpointProfile:
        """What this endpoint does (its multipart ETag style, whether it checks x-amz-checksum-crc32): from
        --s3-multipart-etag / --s3-integrity md5, else probed once a process per (endpoint, bucket, settings)
        (hsx/store/probe.py). A probe that fails raises StoreError (tried again next time); --s3-integrity crc32 on
        a server the probe does not show checking it raises PermanentStoreError naming the flag, at every call."""
        q = self.s.quirks
        if q.multipart_etag != "auto" and q.integrity == "md5":
            return given_profile(q)
        cache_key = (self.s.endpoint_url, self.s.region, self.s.bucket, q)
        with _PROFILES_LOCK:
            known = _PROFILES.get(cache_key)
        if known is None:
            # the CRC32 probe's client has botocore's retries off: the probe judges (and names) every answer
            crc32_client = boto3.session.Session().client("s3", endpoint_url=self.s.endpoint_url, region_name=self.s.region,
                                                          config=q.client_config(max_pool_connections=2, retries=False))
            known = self._call(f"probe {self.url(PROBE_PREFIX)}", lambda: probe(
                self.client, crc32_client, self.s.bucket, self._k(""), q))
            with _PROFILES_LOCK:
                _PROFILES[cache_key] = known
        if q.integrity == "crc32" and not known.crc32:
            raise PermanentStoreError(f"--s3-integrity crc32 (HSX_S3_INTEGRITY) is set, but the store {self.url()} at "
                                      f"{self.s.endpoint_url or 'AWS'} is not shown to verify x-amz-checksum-crc32 "
                                      f"(probed: {known.crc32_why}): a byte flipped in transit could pass; set "
                                      "--s3-integrity auto or md5")
        return known

    def checks_line(self) -> str:
        """One line for a role's start: the endpoint, its quirks and the check hsx makes of each upload kind."""
        return (f"store {self.url()} at {self.s.endpoint_url or 'AWS'}: "
                f"{checks_line(self.s.quirks, self.profile(), self.s.quirks.multipart_etag == 'auto')}")

    def _crc32_mode(self) -> bool:
        """Whether uploads carry x-amz-checksum-crc32 instead of any MD5 (quirks.integrity)."""
        return integrity(self.s.quirks, self.profile()) == "crc32"

    # ---- writes ----------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        """A small object (a manifest, a record) in memory: Content-MD5 and its ETag in every integrity mode (a
        single PUT's ETag is its MD5 on every server; no probe is needed to write one)."""
        sha = hashlib.sha256(data).hexdigest()
        self._call(f"put {self.url(key)}", lambda: self.client.put_object(
            Bucket=self.s.bucket, Key=self._k(key), Body=data, ContentMD5=_md5_b64(data), Metadata={"sha256": sha}))
        return self._verify(key, len(data), sha, md5_etag(hashlib.md5(data).hexdigest()))

    def put_file(self, key: str, path: Path, size: int, sha256: str) -> ObjectInfo:
        """Upload the file, each byte read once (hsx/store/parts.py), and verify it; the file's SHA-256 is
        recomputed from the bytes sent and must equal ``sha256`` (the worker's) before the upload completes."""
        if size < self.s.multipart_threshold:
            crc32 = self._crc32_mode()
            part = _read_single(Path(path), size, sha256, crc32)
            if crc32:
                self._call(f"put {self.url(key)}", lambda: self.client.put_object(
                    Bucket=self.s.bucket, Key=self._k(key), Body=part.body, Metadata={"sha256": sha256},
                    **crc32_args(part.crc32)))
                return self._verify(key, size, sha256, None, crc32_b64(part.crc32))
            self._call(f"put {self.url(key)}", lambda: self.client.put_object(
                Bucket=self.s.bucket, Key=self._k(key), Body=part.body, ContentMD5=base64.b64encode(part.md5).decode(),
                Metadata={"sha256": sha256}))
            return self._verify(key, size, sha256, md5_etag(part.md5.hex()))
        return self._put_multipart(key, Path(path), size, sha256)

    def _put_multipart(self, key: str, path: Path, size: int, sha256: str) -> ObjectInfo:
        # The check that is real on this endpoint (quirks.multipart_check): "composite" hashes each part
        # (its Content-MD5 too), "md5" the whole file once (parts go without Content-MD5: one MD5 pass, not
        # two; a part corrupted on the way still changes the server's whole-object MD5), "readback" sends
        # Content-MD5 on each part and reads the object back after completion. "crc32" (quirks.integrity) sends
        # each part's CRC32 and checks the server's composite of them: no MD5 at all.
        check = "crc32" if self._crc32_mode() else multipart_check(self.s.quirks, self.profile())
        k = self._k(key)
        algorithm = {"ChecksumAlgorithm": "CRC32"} if check == "crc32" else {}
        upload_id = self._call(f"start multipart {self.url(key)}", lambda: self.client.create_multipart_upload(
            Bucket=self.s.bucket, Key=k, Metadata={"sha256": sha256}, **algorithm))["UploadId"]
        try:
            digest, part_md5s, part_crcs, futures = hashlib.sha256(), [], [], []
            whole_md5 = hashlib.md5() if check == "md5" else None  # the whole object's MD5 replaces the parts'
            hashes = (digest,) if whole_md5 is None else (digest, whole_md5)
            with ThreadPoolExecutor(PART_CONCURRENCY) as pool, open(path, "rb", buffering=0) as fh:
                try:
                    for part in read_parts(fh, size, self.s.multipart_chunk, self._buffers, hashes,
                                           part_md5=check in ("composite", "readback"), part_crc32=check == "crc32"):
                        if part.md5 is not None:
                            part_md5s.append(part.md5)
                        if part.crc32 is not None:
                            part_crcs.append(part.crc32)
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
        if check == "crc32":
            return self._verify(key, size, sha256, None, composite_crc32(part_crcs))
        etag = {"composite": lambda: composite_etag(part_md5s), "md5": lambda: md5_etag(whole_md5.hexdigest()),
                "readback": lambda: None}[check]()
        info = self._verify(key, size, sha256, etag)
        if check == "readback":
            self.read_back(key, size, sha256)
        return info

    def _upload_part(self, k: str, upload_id: str, part: Part) -> dict:
        """Send one part, with its Content-MD5 (or x-amz-checksum-crc32) when it has one (its buffer goes back to the
        pool once the part is in, or has failed for good)."""
        extra = {"ContentMD5": base64.b64encode(part.md5).decode()} if part.md5 is not None else {}
        if part.crc32 is not None:
            extra = crc32_args(part.crc32)
        try:
            r = self._call(f"upload part {part.number} of s3://{self.s.bucket}/{k}", lambda: self.client.upload_part(
                Bucket=self.s.bucket, Key=k, UploadId=upload_id, PartNumber=part.number, Body=part.body, **extra))
        finally:
            self._buffers.give(part.body)
        done = {"ETag": r["ETag"], "PartNumber": part.number}
        return done if part.crc32 is None else {**done, "ChecksumCRC32": crc32_b64(part.crc32)}

    def _verify(self, key: str, size: int, sha256: str, etag: str | None, crc32: str | None = None) -> ObjectInfo:
        """HEAD the object: size, ``sha256`` metadata, (``etag`` given, ETag checks on) the ETag and (``crc32``
        given) the ChecksumCRC32 the server stored."""
        extra = {"ChecksumMode": "ENABLED"} if crc32 is not None else {}
        info = self._call(f"head {self.url(key)}", lambda: self.client.head_object(
            Bucket=self.s.bucket, Key=self._k(key), **extra))
        stored_sha = _sha256_metadata(info)
        if not stored_sha:
            raise PermanentStoreError(f"{self.url(key)}: the store kept no sha256 metadata (x-amz-meta-sha256) on the "
                                      "object hsx wrote with it, so it can never be verified; this store drops user "
                                      "metadata and cannot hold an hsx run")
        problems = []
        if info["ContentLength"] != size:
            problems.append(f"size {info['ContentLength']} != {size}")
        if stored_sha != sha256:
            problems.append(f"sha256 metadata {stored_sha!r} != {sha256!r}")
        if etag is not None and self.s.quirks.verify_etag and info.get("ETag") != etag:
            problems.append(f"ETag {info.get('ETag')} != {etag}")
        if crc32 is not None and not crc32_matches(info.get("ChecksumCRC32"), crc32):
            problems.append(f"ChecksumCRC32 {info.get('ChecksumCRC32')} != {crc32}")
        if problems:
            raise VerifyError(f"{self.url(key)} failed verification: {'; '.join(problems)}")
        return ObjectInfo(key, size, sha256)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            info = self._call(f"head {self.url(key)}", lambda: self.client.head_object(Bucket=self.s.bucket, Key=self._k(key)))
        except _Missing:
            return None
        return ObjectInfo(key, info["ContentLength"], _sha256_metadata(info))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        kwargs = {"Bucket": self.s.bucket, "Key": self._k(key)}
        if start is not None or end is not None:
            kwargs["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        try:
            return self._call(f"get {self.url(key)}", lambda: self.client.get_object(**kwargs)["Body"].read())
        except _Missing:
            raise ObjectNotFound(self.url(key)) from None

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

    def list_sizes(self, prefix: str) -> dict[str, int]:
        strip = len(self._k(""))
        sizes = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.s.bucket, Prefix=self._k(prefix)):
            sizes.update((obj["Key"][strip:], int(obj["Size"])) for obj in page.get("Contents", []))
        return sizes

    def delete(self, key: str) -> None:
        self._call(f"delete {self.url(key)}", lambda: self.client.delete_object(Bucket=self.s.bucket, Key=self._k(key)))
