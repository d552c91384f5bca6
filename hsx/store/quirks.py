"""What an S3-compatible endpoint does differently from AWS, in one place.

Settings (flags with HSX_* fallbacks, recorded in the run's manifest; safe defaults):
- ``checksums``: boto3's ``request_checksum_calculation`` and ``response_checksum_validation``.
  ``when_required`` (default) sends only the checksums an operation requires, and hsx's own
  ``Content-MD5``; ``when_supported`` is boto3 >= 1.36's default (a CRC32 header or an aws-chunked
  body with a trailer on every upload), which some S3-compatible servers reject with a 400.
- ``addressing_style``: auto | path | virtual (most self-hosted servers want ``path``).
- ``multipart_etag``: how a multipart object's ETag is formed on this endpoint, which decides the
  check hsx makes of it before any spool file is deleted. ``auto`` (default) learns it once per
  process with a small two-part probe upload; ``composite`` (AWS, moto: ``md5(md5(part)..)-N``),
  ``md5`` (rclone: the MD5 of the whole object) or ``readback`` (every multipart object is read
  back and its SHA-256 checked) skip the probe.
- ``verify_etag``: off for stores whose ETag is no MD5 at all (SSE-KMS); multipart objects are then
  read back, single-part ones rest on the server's ``Content-MD5`` check.

What the probe learns is an ``EndpointProfile``, said in one start line (``S3Store.checks_line``).
Conditional writes (``If-None-Match: *``) are probed and reported only: hsx relies on none (every
key is deterministic and a batch's upload is leased, docs/reliability.md), so a server that
ignores them (rclone) changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from dataclasses import dataclass

from botocore.config import Config
from botocore.exceptions import ClientError

CHECKSUM_MODES = ("when_required", "when_supported")
ADDRESSING_STYLES = ("auto", "path", "virtual")
MULTIPART_ETAG_MODES = ("auto", "composite", "md5", "readback")
PROBE_PART = 5 * 2**20     # bytes of the probe's first part: S3's least size of a part that is not the last
PROBE_PREFIX = ".hsx-probe/"  # under the store's prefix; no run name starts with '.'
# 400s that are faults in transit, never a server refusing a checksum header (kept retryable).
TRANSIENT_400 = ("BadDigest", "RequestTimeout", "IncompleteBody", "InvalidDigest", "XAmzContentSHA256Mismatch")


class QuirkError(ValueError):
    """A quirk setting hsx does not know; the message names the setting."""


@dataclass(frozen=True)
class EndpointQuirks:
    addressing_style: str = "auto"
    checksums: str = "when_required"
    multipart_etag: str = "auto"
    verify_etag: bool = True

    def __post_init__(self):
        for value, allowed, flag in ((self.addressing_style, ADDRESSING_STYLES, "--s3-addressing-style"),
                                     (self.checksums, CHECKSUM_MODES, "--s3-checksums"),
                                     (self.multipart_etag, MULTIPART_ETAG_MODES, "--s3-multipart-etag")):
            if value not in allowed:
                raise QuirkError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")

    def client_config(self, max_pool_connections: int) -> Config:
        """botocore's Config for this endpoint: addressing, checksum mode, retries, connection pool."""
        # payload_signing_enabled False: UNSIGNED-PAYLOAD (the body is covered by its signed Content-MD5 header, or
        # by the ETag checked after the upload), not a SHA-256 of every body over http (~0.6 s a GiB)
        return Config(s3={"addressing_style": self.addressing_style, "payload_signing_enabled": False},
                      request_checksum_calculation=self.checksums, response_checksum_validation=self.checksums,
                      retries={"max_attempts": 5, "mode": "adaptive"}, max_pool_connections=max_pool_connections)

    def refusal_hint(self, code: str | None, status: int | None) -> str | None:
        """The fix to name when the store refuses a request in a way default checksums explain, else None."""
        if self.checksums == "when_supported" and status in (400, 501) and code not in TRANSIENT_400:
            return ("the store may reject boto3's default request checksums (--s3-checksums when_supported); "
                    "set --s3-checksums when_required (HSX_S3_CHECKSUMS=when_required)")
        return None


@dataclass(frozen=True)
class EndpointProfile:
    """What one endpoint does, learned by ``probe`` (or given by the settings)."""

    multipart_etag: str            # composite | md5 | opaque
    conditional_writes: bool | None  # If-None-Match: * refused a second write (None: not probed)


def composite_etag(part_md5s: list[bytes]) -> str:
    return f'"{hashlib.md5(b"".join(part_md5s)).hexdigest()}-{len(part_md5s)}"'


def md5_etag(md5_hex: str) -> str:
    return f'"{md5_hex}"'


def probe(client, bucket: str, key_prefix: str) -> EndpointProfile:
    """Upload a two-part object (PROBE_PART + 4 bytes) and a create-only write under ``key_prefix``
    + PROBE_PREFIX, read what the server says, delete both. Raises ClientError/BotoCoreError."""
    key = f"{key_prefix}{PROBE_PREFIX}{uuid.uuid4().hex}"
    parts = [bytes(PROBE_PART), b"hsx\n"]
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        done = [{"PartNumber": n, "ETag": client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=body,
            ContentMD5=base64.b64encode(hashlib.md5(body).digest()).decode())["ETag"]}
            for n, body in enumerate(parts, 1)]
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
    except BaseException:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        raise
    try:
        etag = client.head_object(Bucket=bucket, Key=key).get("ETag")
        if etag == composite_etag([hashlib.md5(p).digest() for p in parts]):
            style = "composite"
        elif etag == md5_etag(hashlib.md5(b"".join(parts)).hexdigest()):
            style = "md5"
        else:
            style = "opaque"
        try:
            client.put_object(Bucket=bucket, Key=key, Body=b"again", IfNoneMatch="*")
            conditional = False
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") not in (409, 412):
                raise
            conditional = True
    finally:
        client.delete_object(Bucket=bucket, Key=key)
    return EndpointProfile(style, conditional)


def multipart_check(quirks: EndpointQuirks, profile: EndpointProfile) -> str:
    """The check of a multipart object that is real on this endpoint: composite | md5 | readback."""
    if not quirks.verify_etag or quirks.multipart_etag == "readback":
        return "readback"
    return {"composite": "composite", "md5": "md5"}.get(profile.multipart_etag, "readback")


CHECK_WORDS = {
    "composite": "ETag = md5(md5(part)..)-N of the bytes read (Content-MD5 on each part)",
    "md5": "ETag = MD5 of the whole object, hashed while reading (the server's ETag is its own MD5 of what it stored)",
    "readback": "every multipart object read back and its SHA-256 checked (the ETag says nothing hsx can check)",
}


def checks_line(quirks: EndpointQuirks, profile: EndpointProfile, probed: bool) -> str:
    """One line: the endpoint's quirks and the check hsx makes of each upload kind there."""
    single = ("ETag = MD5 + Content-MD5" if quirks.verify_etag
              else "Content-MD5 only (--s3-verify-etag no)")
    conditional = {True: "honoured", False: "ignored", None: "not probed"}[profile.conditional_writes]
    return (f"multipart ETag {profile.multipart_etag} ({'probed' if probed else 'set by --s3-multipart-etag'}); "
            f"checks: single-part {single}, size and sha256 metadata; multipart "
            f"{CHECK_WORDS[multipart_check(quirks, profile)]}; checksums {quirks.checksums}, addressing "
            f"{quirks.addressing_style}; conditional writes {conditional} (hsx relies on none)")
