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
- ``integrity``: the checksum the server verifies on every upload request. ``md5``: Content-MD5 per request and
  the ETag checks above. ``crc32``: ``x-amz-checksum-crc32`` per request (PutObject, each UploadPart; multipart
  uploads created with ChecksumAlgorithm CRC32) and, after completion, HeadObject with ChecksumMode ENABLED
  must answer the CRC32 hsx computed (the composite ``crc32(crc32(part)..)-N`` for multipart): no MD5 at all,
  ~45 % less uploader CPU (docs/benchmarks.md). ``auto`` (default) uses crc32 only where the probe
  (hsx/store/probe.py) saw the server refuse a deliberately wrong ``x-amz-checksum-crc32`` as a checksum mismatch
  (a 400 BadDigest or the like: a 503, 500 or 403 is no such sign) on a PUT and on a part, and store the right
  ones (AWS, SeaweedFS; MinIO documents it); elsewhere (rclone and moto store whatever value they are sent,
  unchecked), or where the probe's answers never settle it, it keeps md5. ``crc32`` set on a server the probe does
  not show checking it is refused (PermanentStoreError naming the flag). The file's SHA-256 (recomputed from the
  bytes sent, kept as metadata) is checked in every mode.
- ``verify_etag``: off for stores whose ETag is no MD5 at all (SSE-KMS); multipart objects are then
  read back, single-part ones rest on the server's ``Content-MD5`` check.

What the probe learns (the multipart ETag style, probed only when its setting is ``auto``; whether the server checks
CRC32, probed unless ``integrity`` is ``md5``) is an ``EndpointProfile``, said in one start line
(``S3Store.checks_line``).
Conditional writes (``If-None-Match: *``) are probed and reported only: hsx relies on none (every
key is deterministic and a batch's upload is leased, docs/reliability.md), so a server that
ignores them (rclone) changes nothing.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from dataclasses import dataclass

from botocore.config import Config

CHECKSUM_MODES = ("when_required", "when_supported")
ADDRESSING_STYLES = ("auto", "path", "virtual")
MULTIPART_ETAG_MODES = ("auto", "composite", "md5", "readback")
INTEGRITY_MODES = ("auto", "md5", "crc32")
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
    integrity: str = "auto"

    def __post_init__(self):
        for value, allowed, flag in ((self.addressing_style, ADDRESSING_STYLES, "--s3-addressing-style"),
                                     (self.checksums, CHECKSUM_MODES, "--s3-checksums"),
                                     (self.multipart_etag, MULTIPART_ETAG_MODES, "--s3-multipart-etag"),
                                     (self.integrity, INTEGRITY_MODES, "--s3-integrity")):
            if value not in allowed:
                raise QuirkError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")

    def client_config(self, max_pool_connections: int, retries: bool = True) -> Config:
        """botocore's Config for this endpoint: addressing, checksum mode, retries (``retries`` False: one attempt
        a call, as for the probe's client, which judges each answer itself), connection pool."""
        # payload_signing_enabled False: UNSIGNED-PAYLOAD (the body is covered by its signed Content-MD5 header, or
        # by the ETag checked after the upload), not a SHA-256 of every body over http (~0.6 s a GiB)
        return Config(s3={"addressing_style": self.addressing_style, "payload_signing_enabled": False},
                      request_checksum_calculation=self.checksums, response_checksum_validation=self.checksums,
                      retries={"max_attempts": 5, "mode": "adaptive"} if retries else {"total_max_attempts": 1},
                      max_pool_connections=max_pool_connections)

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
    crc32: bool | None = None      # the server checks and stores x-amz-checksum-crc32 (None: not probed)
    crc32_why: str = ""            # what the probe saw, for the start line


def composite_etag(part_md5s: list[bytes]) -> str:
    return f'"{hashlib.md5(b"".join(part_md5s)).hexdigest()}-{len(part_md5s)}"'


def md5_etag(md5_hex: str) -> str:
    return f'"{md5_hex}"'


def crc32_b64(crc: int) -> str:
    """A CRC32 as S3 writes it (x-amz-checksum-crc32, ChecksumCRC32): base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def composite_crc32(part_crcs: list[int]) -> str:
    """A multipart object's composite ChecksumCRC32: the CRC32 of the parts' CRC32s, then ``-N``."""
    return f"{crc32_b64(zlib.crc32(b''.join(c.to_bytes(4, 'big') for c in part_crcs)))}-{len(part_crcs)}"


def crc32_matches(stored: str | None, expected: str) -> bool:
    """The server's ChecksumCRC32 is the one expected; a multipart object's may come without its ``-N``
    (moto 5.2.5 answers HEAD so): the CRC32 of the parts' CRC32s is the check, N a count checked when given."""
    if stored is None:
        return False
    crc, _, count = expected.partition("-")
    return stored == expected or (bool(count) and stored == crc)


def crc32_args(crc: int) -> dict:
    """A request's checksum arguments in crc32 mode (the algorithm header too: moto stores the value only then)."""
    return {"ChecksumAlgorithm": "CRC32", "ChecksumCRC32": crc32_b64(crc)}


def integrity(quirks: EndpointQuirks, profile: EndpointProfile) -> str:
    """The checksum hsx sends and checks on this endpoint: crc32 where set or where the probe saw it checked, else md5."""
    if quirks.integrity == "auto":
        return "crc32" if profile.crc32 else "md5"
    return quirks.integrity


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
    conditional = {True: "honoured", False: "ignored", None: "not probed"}[profile.conditional_writes]
    etag = f"multipart ETag {profile.multipart_etag} ({'probed' if probed else 'set by --s3-multipart-etag'})"
    if integrity(quirks, profile) == "crc32":
        why = (f"probed: {profile.crc32_why}" if quirks.integrity == "auto"
               else f"set by --s3-integrity crc32, probed: {profile.crc32_why}")
        checks = (f"integrity crc32 ({why}); checks: x-amz-checksum-crc32 on every request, HEAD ChecksumCRC32 = "
                  "the CRC32 of the bytes read (multipart: the composite crc32(crc32(part)..)-N), size and sha256 "
                  "metadata; no MD5")
    else:
        why = (f"probed: {profile.crc32_why}" if quirks.integrity == "auto" else "set by --s3-integrity md5")
        single = ("ETag = MD5 + Content-MD5" if quirks.verify_etag
                  else "Content-MD5 only (--s3-verify-etag no)")
        checks = (f"integrity md5 ({why}); checks: single-part {single}, size and sha256 metadata; multipart "
                  f"{CHECK_WORDS[multipart_check(quirks, profile)]}")
    return (f"{etag}; {checks}; checksums {quirks.checksums}, addressing {quirks.addressing_style}; "
            f"conditional writes {conditional} (hsx relies on none)")
