"""The store's start check: an S3 store answers within seconds, or the role says in one line why not.

Like Redis's (hsx/redisconn.py ``check_reachable``): before a role does any work, one short-timeout, no-retry
look at the store (a wrong ``--s3-endpoint-url`` took 58 s and 7 retry warnings to surface,
with a message naming no setting). In order, each answer naming the setting to check:

1. reachable: the endpoint answers at all (``--s3-endpoint-url`` / ``HSX_S3_ENDPOINT_URL``);
2. credentials found (none in boto3's chain: the AWS variables are named, not the endpoint), accepted and the
   bucket exists: HEAD of the bucket (403: the AWS credentials;
   404: the bucket in ``--store``; a redirect or 400: ``--s3-region``);
3. a write allowed (roles that write): PUT of ``<prefix>/.hsx-write-check``, the same few bytes every time
   (idempotent; outside every run's folder, so no run ever lists it);
4. ``check_integrity`` (the uploader): ``--s3-integrity crc32`` only on a server the start probe shows refusing a
   wrong x-amz-checksum-crc32 (hsx/store/probe.py), else one line naming the flag.

The whole check takes at most ``seconds`` (default 10). A local store is checked elsewhere
(hsx/localdirs.py, hsx/runspec/visibility.py): nothing to do here.
"""

from __future__ import annotations

import time

from hsx.errors import HsxError
from hsx.store.settings import StoreSettings

START_CHECK_SECONDS = 10.0  # s: the longest the store's start check may take (as Redis's)
WRITE_CHECK_KEY = ".hsx-write-check"  # under the store's prefix; same bytes every time
WRITE_CHECK_BYTES = b"hsx start check: this store takes writes\n"
ENDPOINT = "--s3-endpoint-url / HSX_S3_ENDPOINT_URL"


class StoreUnusable(HsxError):
    """The store did not pass its start check; the message names the setting to check."""


def _settings_source(role: str) -> str:
    """Where the role's store settings come from: its own flags, or the run's manifest."""
    if role in ("worker", "uploader", "verify"):
        return " (the run's store settings, recorded by `hsx produce`)"
    return ""


def check_store(settings: StoreSettings, role: str, write: bool = True, seconds: float = START_CHECK_SECONDS,
                run: str | None = None) -> None:
    """StoreUnusable within ``seconds`` if the S3 store of ``settings`` is unreachable, refuses the credentials,
    has no such bucket or (``write``) refuses a write; nothing for a local store."""
    if settings.is_local:
        return
    import boto3
    from botocore.config import Config
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    bucket, _, prefix = settings.url.removeprefix("s3://").partition("/")
    endpoint = settings.endpoint_url or f"AWS's endpoint for region {settings.region or 'from the AWS config'}"
    whose = f"{role}{' of run ' + run if run else ''}"
    where = f"S3 store {settings.url} at {endpoint}{_settings_source(role)}"
    deadline = time.monotonic() + seconds

    def client():
        left = max(deadline - time.monotonic(), 0.5)
        return boto3.session.Session().client(
            "s3", endpoint_url=settings.endpoint_url, region_name=settings.region,
            config=Config(s3={"addressing_style": settings.addressing_style}, connect_timeout=min(3.0, left),
                          read_timeout=min(5.0, left), retries={"max_attempts": 1, "mode": "standard"}))

    def refused(exc: Exception, step: str) -> StoreUnusable:
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):  # before any request: not the endpoint
            return StoreUnusable(f"{whose}: found no AWS credentials for the {where} ({type(exc).__name__}: "
                                 f"{str(exc)[:200]}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                                 "(boto3's credential chain)")
        if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)) or not isinstance(exc, ClientError):
            reason = str(exc).splitlines()[0][:200]
            return StoreUnusable(f"{whose}: cannot reach the {where} ({type(exc).__name__}: {reason}) within "
                                 f"{seconds:.0f} s: check {ENDPOINT} (and that the store runs there)")
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))
        message = str(error.get("Message") or "")[:200]
        answer = f"{code}{': ' + message if message else ''}"
        if code in ("404", "NoSuchBucket"):
            return StoreUnusable(f"{whose}: bucket {bucket!r} does not exist in the {where} ({step}: {answer}): check "
                                 f"the bucket in --store / HSX_STORE, and {ENDPOINT}")
        if code in ("301", "PermanentRedirect", "AuthorizationHeaderMalformed", "400", "IllegalLocationConstraintException"):
            return StoreUnusable(f"{whose}: the {where} answered {answer} ({step}): check --s3-region / HSX_S3_REGION "
                                 f"and {ENDPOINT}")
        if step == "write" and code in ("403", "AccessDenied"):
            return StoreUnusable(f"{whose}: the {where} refuses writes under {prefix or 'the bucket root'!r} ({answer}): "
                                 "give these AWS credentials s3:PutObject there, or choose another --store")
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                    "ExpiredToken"):
            return StoreUnusable(f"{whose}: the {where} refused the credentials ({step}: {answer}): check "
                                 "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE (boto3's credential chain), "
                                 f"and {ENDPOINT}")
        return StoreUnusable(f"{whose}: the {where} answered {answer} ({step}): check {ENDPOINT}, --store and the "
                             "AWS credentials")

    try:
        client().head_bucket(Bucket=bucket)
    except (BotoCoreError, ClientError, OSError) as exc:
        raise refused(exc, "bucket check") from None
    if write:
        key = f"{prefix.strip('/')}/{WRITE_CHECK_KEY}" if prefix.strip("/") else WRITE_CHECK_KEY
        try:
            client().put_object(Bucket=bucket, Key=key, Body=WRITE_CHECK_BYTES)
        except (BotoCoreError, ClientError, OSError) as exc:
            raise refused(exc, "write") from None


def check_integrity(settings: StoreSettings, role: str, run: str | None = None) -> None:
    """StoreUnusable, one line naming --s3-integrity, if it is crc32 and the store's probe does not show the server
    checking x-amz-checksum-crc32; nothing for any other setting or a local store. A probe that cannot be made
    now is no refusal (each upload probes again, and is refused there)."""
    if settings.is_local or settings.integrity != "crc32":
        return
    from hsx.store.base import PermanentStoreError, StoreError

    try:
        settings.open().profile()
    except PermanentStoreError as exc:
        raise StoreUnusable(f"{role}{' of run ' + run if run else ''}: {exc}") from None
    except StoreError:
        pass
