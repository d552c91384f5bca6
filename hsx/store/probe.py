"""The start probe of an S3 endpoint: what its server does, learned by small uploads under ``<prefix>/.hsx-probe/``.

- ``probe_crc32``: does the server check ``x-amz-checksum-crc32``? Only a checksum refusal counts (a 400 whose
  code is one of CHECKSUM_REFUSALS), and it is confirmed: the right CRC32 must then be stored and answered on HEAD,
  a wrong one on an UploadPart refused the same way and the parts' composite stored. An answer
  that passes (5xx, 429, a throttle, no answer) is asked again, at most PROBE_TRIES times, through a client whose
  own retries are off so that each answer is seen; any other answer (a 403, an unknown 400, acceptance) means md5.
  What was seen, retries included, is the ``why`` said in the uploader's start line.
- ``probe_etag``: how a multipart object's ETag is formed (a two-part upload), and whether a create-only write
  (``If-None-Match: *``) over an existing key is refused.
Every probe object is deleted after.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
import zlib
from collections.abc import Callable

from botocore.exceptions import BotoCoreError, ClientError

from hsx.retry import backoff_delay, pause
from hsx.store.quirks import (
    PROBE_PART,
    PROBE_PREFIX,
    EndpointProfile,
    EndpointQuirks,
    composite_crc32,
    composite_etag,
    crc32_args,
    crc32_b64,
    crc32_matches,
    md5_etag,
)

# 400 codes with which S3 servers refuse a checksum that does not match the body (AWS, SeaweedFS: BadDigest; MinIO:
# XAmzContentChecksumMismatch; InvalidRequest / InvalidDigest where a server words it so). Nothing else counts.
CHECKSUM_REFUSALS = ("BadDigest", "InvalidDigest", "InvalidRequest", "XAmzContentChecksumMismatch")
# Answers that pass: asked again. Status >= 500 and 429 pass whatever their code.
PASSING_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestLimitExceeded",
                 "TooManyRequests", "ServiceUnavailable", "InternalError")
PROBE_TRIES = 4                # tries of one probe request whose answer passes (then md5 is kept)
PROBE_BACKOFF_SECONDS = 0.5    # base of the full-jitter back-off between them (hsx.retry.backoff_delay): <= 3.5 s
PROBE_BODY = b"hsx checksum probe\n"


def given_profile(quirks: EndpointQuirks) -> EndpointProfile:
    """What the settings say without a probe: the multipart ETag style (readback: opaque), nothing else."""
    return EndpointProfile({"readback": "opaque"}.get(quirks.multipart_etag, quirks.multipart_etag), None)


def probe(client, crc32_client, bucket: str, key_prefix: str, quirks: EndpointQuirks) -> EndpointProfile:
    """Under ``key_prefix`` + PROBE_PREFIX: ``probe_crc32`` (through ``crc32_client``, botocore's retries off) unless
    ``quirks.integrity`` is md5, ``probe_etag`` where ``quirks.multipart_etag`` is auto. Raises ClientError /
    BotoCoreError (the probe could not be made)."""
    key = f"{key_prefix}{PROBE_PREFIX}{uuid.uuid4().hex}"
    checked, why = probe_crc32(crc32_client, bucket, key + "-crc32") if quirks.integrity != "md5" else (None, "")
    style, conditional = given_profile(quirks).multipart_etag, None
    if quirks.multipart_etag == "auto":
        style, conditional = probe_etag(client, bucket, key)
    return EndpointProfile(style, conditional, checked, why)


def _answer(exc: ClientError) -> tuple[int | None, str]:
    """(HTTP status, error code) of a refused request; the code is '' where the answer had none."""
    return (exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
            str(exc.response.get("Error", {}).get("Code") or ""))


def _words(exc: ClientError) -> str:
    status, code = _answer(exc)
    return " ".join(str(w) for w in (status, code) if w) or "an error"


def _passes(exc: ClientError) -> bool:
    status, code = _answer(exc)
    return status is None or status >= 500 or status == 429 or code in PASSING_CODES


def is_checksum_refusal(exc: ClientError) -> bool:
    """A 400 that says the checksum sent does not match the body: nothing else shows the server checks it."""
    status, code = _answer(exc)
    return status == 400 and code in CHECKSUM_REFUSALS


def _send(call: Callable[[], dict]) -> tuple[dict | ClientError, list[str]]:
    """(the answer: a response, or the ClientError that is the server's last word, and the passing answers seen
    before it). A passing answer is asked again, at most PROBE_TRIES times in all (a stop request ends the
    waiting); no answer at all on the last try raises BotoCoreError."""
    seen: list[str] = []
    for k in range(PROBE_TRIES):
        last = k == PROBE_TRIES - 1
        try:
            return call(), seen
        except ClientError as exc:
            if last or not _passes(exc):
                return exc, seen
            seen.append(_words(exc))
        except BotoCoreError as exc:
            if last:
                raise
            seen.append(type(exc).__name__)
        if pause(backoff_delay(k, PROBE_BACKOFF_SECONDS)):
            raise ConnectionError("stop requested during the store's probe")
    raise AssertionError("unreachable")


def _retried(seen: list[str]) -> str:
    return f" after {len(seen)} {'retry' if len(seen) == 1 else 'retries'} ({', '.join(seen)})" if seen else ""


def _refused(call: Callable[[], dict], what: str) -> tuple[str | None, str]:
    """Send a request carrying a WRONG checksum: (how it was refused, '') for a checksum refusal, else
    (None, why that is no sign the server checks it)."""
    answer, seen = _send(call)
    if not isinstance(answer, ClientError):
        return None, f"{what} was accepted{_retried(seen)}: the server does not check it"
    if is_checksum_refusal(answer):
        return f"{_words(answer)}{_retried(seen)}", ""
    if _passes(answer):
        return None, (f"{what} was answered {_words(answer)} on {len(seen) + 1} tries, never refused as a checksum "
                      "mismatch: md5 kept (probed again at the next start)")
    return None, (f"{what} was answered {_words(answer)}{_retried(seen)}, which is no checksum refusal "
                  f"(400 {' / '.join(CHECKSUM_REFUSALS)}): md5 kept")


def _accepted(call: Callable[[], dict]) -> tuple[dict | None, str]:
    """Send a request that must succeed: (its response, '') or (None, the answer it got instead)."""
    answer, seen = _send(call)
    if isinstance(answer, ClientError):
        return None, f"{_words(answer)}{_retried(seen)}"
    return answer, ""


def probe_crc32(client, bucket: str, key: str) -> tuple[bool, str]:
    """Does the server check and store x-amz-checksum-crc32? (True | False, what was seen). ``client`` should
    have botocore's retries off (each answer is judged here). Raises BotoCoreError (no answer at all)."""
    body, wrong = PROBE_BODY, crc32_args(zlib.crc32(b"not " + PROBE_BODY))
    try:
        refused, why = _refused(lambda: client.put_object(Bucket=bucket, Key=key, Body=body, **wrong),
                                "a wrong x-amz-checksum-crc32")
        if refused is None:
            return False, why
        put, failed = _accepted(lambda: client.put_object(Bucket=bucket, Key=key, Body=body,
                                                          **crc32_args(zlib.crc32(body))))
        if put is None:
            return False, f"a wrong x-amz-checksum-crc32 was refused ({refused}), but so was the right one ({failed})"
        head, failed = _accepted(lambda: client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"))
        stored = head.get("ChecksumCRC32") if head else f"answered {failed}"
        if stored != crc32_b64(zlib.crc32(body)):
            return False, f"the server refused a wrong CRC32 ({refused}) but did not store the right one (HEAD: {stored})"
        return _probe_parts(client, bucket, key, refused)
    finally:
        try:
            client.delete_object(Bucket=bucket, Key=key)
        except (BotoCoreError, ClientError):
            pass   # nothing was stored, or a lifecycle rule on .hsx-probe/ reaps it


def _probe_parts(client, bucket: str, key: str, refused: str) -> tuple[bool, str]:
    """The confirmation: a wrong CRC32 on an UploadPart refused as a checksum mismatch too, the right parts kept
    and their composite answered on HEAD."""
    parts = [bytes(PROBE_PART), b"hsx\n"]
    created, failed = _accepted(lambda: client.create_multipart_upload(Bucket=bucket, Key=key,
                                                                       ChecksumAlgorithm="CRC32"))
    if created is None:
        return False, f"single-part CRC32 checked, but a multipart upload with CRC32 was refused ({failed})"
    upload = created["UploadId"]
    try:
        part_refused, why = _refused(lambda: client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=parts[1],
            **crc32_args(zlib.crc32(b"not " + parts[1]))), "a wrong x-amz-checksum-crc32 on a part")
        if part_refused is None:
            return False, f"a wrong x-amz-checksum-crc32 was refused ({refused}) on a PUT, but {why}"
        done = []
        for number, part in enumerate(parts, 1):
            sent, failed = _accepted(lambda n=number, p=part: client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload, PartNumber=n, Body=p, **crc32_args(zlib.crc32(p))))
            if sent is None:
                return False, f"single-part CRC32 checked, but a part with the right CRC32 was refused ({failed})"
            done.append({"PartNumber": number, "ETag": sent["ETag"], "ChecksumCRC32": crc32_b64(zlib.crc32(part))})
        completed, failed = _accepted(lambda: client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done}))
        if completed is None:
            return False, f"single-part CRC32 checked, but a multipart upload with CRC32 was refused ({failed})"
        upload = None
    finally:
        if upload is not None:
            try:
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
            except (BotoCoreError, ClientError):
                pass
    head, failed = _accepted(lambda: client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED"))
    stored = head.get("ChecksumCRC32") if head else f"answered {failed}"
    if not crc32_matches(stored, composite_crc32([zlib.crc32(p) for p in parts])):
        return False, f"single-part CRC32 checked, but a multipart object's composite CRC32 was not stored (HEAD: {stored})"
    return True, (f"a wrong x-amz-checksum-crc32 was refused ({refused}), on a part too ({part_refused}), "
                  "the right ones stored")


def probe_etag(client, bucket: str, key: str) -> tuple[str, bool]:
    """Upload a two-part object (PROBE_PART + 4 bytes) at ``key``, then try a create-only write over it:
    (multipart ETag style: composite | md5 | opaque, whether If-None-Match: * was refused). Deletes it.
    Raises ClientError/BotoCoreError."""
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
    return style, conditional
