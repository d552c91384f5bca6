"""The store: where batch objects, inputs, manifest and index land.

Keys are '/'-separated paths relative to the store root (``<prefix>`` of
``s3://bucket/prefix`` or a local directory). Writes of the same key with the
same bytes are idempotent.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import HsxError


class StoreError(HsxError, RuntimeError):
    """A store call failed for good (after retries)."""


class PermanentStoreError(StoreError):
    """The store refused in a way retrying cannot fix (access denied, no such bucket, user metadata
    dropped); the message carries the store's own words. Never retried by the store layer."""


class VerifyError(StoreError):
    """An object in the store does not match the bytes that were sent."""


class ObjectNotFound(HsxError, KeyError):
    """The store has no object at this key (its address is the argument). A KeyError, as the store's "not
    found" always was: code that caught KeyError still does; catch this, so that a KeyError of a bug nearby is
    not taken for a missing object. An HsxError: where nothing catches it, the CLI says it in one line."""

    def __str__(self) -> str:
        return f"no object at {self.args[0]}" if self.args else "no object"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    sha256: str | None  # hex digest of the whole object where the store can tell it


class Store(ABC):
    @abstractmethod
    def url(self, key: str = "") -> str:
        """Human-readable address of a key (no credentials)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        """Store ``data`` at ``key`` and verify it landed whole."""

    @abstractmethod
    def put_file(self, key: str, path: Path, size: int, sha256: str) -> ObjectInfo:
        """Upload a local file and verify size and checksum; raise VerifyError otherwise."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size (and checksum where known) of ``key``, or None if absent."""

    @abstractmethod
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``key`` (the whole object by default); ObjectNotFound if absent."""

    def read_back(self, key: str, size: int, sha256: str) -> None:
        """GET ``key`` and check its size and SHA-256 against the bytes sent; VerifyError otherwise.

        For stores whose HEAD (what ``put_*`` verifies with) may answer for an object that is not
        there, or not whole: ``hsx upload --verify-readback``. Costs one read of every object.
        """
        try:
            data = self.get_bytes(key)
        except ObjectNotFound:
            raise VerifyError(f"{self.url(key)}: read back after upload: the object is missing") from None
        check_read_back(self.url(key), len(data), hashlib.sha256(data).hexdigest(), size, sha256)

    def checks_line(self) -> str | None:
        """One line for a role's start: how this store's uploads are checked, where that depends on the
        endpoint (S3); None where it does not."""
        return None

    @abstractmethod
    def list_keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursive), sorted."""

    def list_sizes(self, prefix: str) -> dict[str, int]:
        """Key -> size in bytes of every object under ``prefix``, from the listing where the store's listing tells
        sizes (one request a thousand objects on S3, a stat a file on disk); here, a HEAD an object."""
        sizes = {}
        for key in self.list_keys(prefix):
            head = self.head(key)
            if head is not None:
                sizes[key] = head.size
        return sizes

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    def remove_empty_folders(self, prefix: str) -> None:
        """After every object under ``prefix`` was deleted (`hsx reset --store`): what is left of its folders.
        An object store has no folders: nothing to do."""
        return None


def check_read_back(where: str, got_size: int, got_sha256: str, size: int, sha256: str) -> None:
    if (got_size, got_sha256) != (size, sha256):
        raise VerifyError(f"{where}: read back after upload: {got_size} bytes sha256 {got_sha256[:12]}, sent {size} "
                          f"bytes sha256 {sha256[:12]} (the store's HEAD said it was whole)")
