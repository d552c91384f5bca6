"""Open a store from its URL: ``s3://bucket/prefix`` or a local directory."""

from __future__ import annotations

from pathlib import Path

from hsx.errors import HsxError
from hsx.store import layout
from hsx.store.base import ObjectInfo, ObjectNotFound, PermanentStoreError, Store, StoreError, VerifyError
from hsx.store.local import LocalStore
from hsx.store.quirks import EndpointQuirks
from hsx.store.settings import StoreSettings
from hsx.store.startcheck import check_integrity, check_store

__all__ = [
    "Store", "ObjectInfo", "ObjectNotFound", "StoreError", "PermanentStoreError", "VerifyError", "StoreURLError", "LocalStore",
    "StoreSettings", "EndpointQuirks", "open_store", "check_store", "check_integrity",
    "layout",  # a namespace: the object keys of a run
]


class StoreURLError(HsxError, ValueError):
    """A store URL hsx cannot open."""


def open_store(url: str, endpoint_url: str | None = None, region: str | None = None,
               quirks: EndpointQuirks | str | None = None) -> Store:
    """``quirks``: the endpoint's (hsx/store/quirks.py); a string is an addressing style, the rest default."""
    if url.startswith("s3://"):
        from hsx.store.s3 import S3Settings, S3Store

        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise StoreURLError(f"store URL {url!r} names no bucket (want s3://bucket/prefix)")
        if not isinstance(quirks, EndpointQuirks):
            quirks = EndpointQuirks(addressing_style=quirks or "auto")
        return S3Store(S3Settings(bucket=bucket, prefix=prefix, endpoint_url=endpoint_url, region=region, quirks=quirks))
    if "://" in url and not url.startswith("file://"):
        raise StoreURLError(f"store URL {url!r}: only s3:// and local directories are supported")
    return LocalStore(Path(url.removeprefix("file://")))
