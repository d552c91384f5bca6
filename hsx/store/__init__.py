"""Open a store from its URL: ``s3://bucket/prefix`` or a local directory."""

from __future__ import annotations

from pathlib import Path

from hsx.errors import HsxError
from hsx.store.base import ObjectInfo, PermanentStoreError, Store, StoreError, VerifyError
from hsx.store.local import LocalStore

__all__ = ["ObjectInfo", "Store", "StoreError", "PermanentStoreError", "VerifyError", "LocalStore", "open_store", "StoreURLError"]


class StoreURLError(HsxError, ValueError):
    """A store URL hsx cannot open."""


def open_store(url: str, endpoint_url: str | None = None, region: str | None = None,
               addressing_style: str = "auto", verify_etag: bool = True) -> Store:
    if url.startswith("s3://"):
        from hsx.store.s3 import S3Settings, S3Store

        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise StoreURLError(f"store URL {url!r} names no bucket (want s3://bucket/prefix)")
        return S3Store(S3Settings(bucket=bucket, prefix=prefix, endpoint_url=endpoint_url, region=region,
                                  addressing_style=addressing_style, verify_etag=verify_etag))
    if "://" in url and not url.startswith("file://"):
        raise StoreURLError(f"store URL {url!r}: only s3:// and local directories are supported")
    return LocalStore(Path(url.removeprefix("file://")))
