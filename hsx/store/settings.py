"""How to reach a store: its URL and the endpoint's settings, as a run records them. No credentials."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from hsx.errors import ConfigError


def _endpoint_has_scheme(endpoint_url: str | None) -> None:
    """ConfigError naming http:// unless ``endpoint_url`` is absent or an http(s) URL with a host (botocore's
    own answer to "127.0.0.1:9000" is a ValueError naming no setting)."""
    if not endpoint_url:
        return
    scheme, sep, rest = endpoint_url.partition("://")
    if sep and scheme.lower() in ("http", "https") and rest.strip("/"):
        return
    where = rest if sep else endpoint_url
    raise ConfigError(f"S3 endpoint {endpoint_url!r} needs a scheme: http:// or https://, e.g. "
                      f"http://{where.strip('/') or '127.0.0.1:9000'} (--s3-endpoint-url / HSX_S3_ENDPOINT_URL)")


@dataclass(frozen=True)
class StoreSettings:
    """Where outputs land. ``url``: s3://bucket/prefix or a local directory. No credentials here."""

    url: str
    endpoint_url: str | None = None
    region: str | None = None
    # An S3-compatible endpoint's quirks (hsx/store/quirks.py says what each means and its choices).
    addressing_style: str = "auto"
    verify_etag: bool = True
    checksums: str = "when_required"
    multipart_etag: str = "auto"
    integrity: str = "auto"

    @classmethod
    def resolve(cls, url: str | None, endpoint_url: str | None = None, region: str | None = None,
                addressing_style: str | None = None, verify_etag: bool | None = None,
                recorded: dict | None = None, checksums: str | None = None,
                multipart_etag: str | None = None, integrity: str | None = None) -> StoreSettings:
        """Given settings (flags or environment, already resolved), then what the run recorded, then defaults."""
        recorded = recorded or {}
        url = url or recorded.get("url")
        if not url:
            raise ConfigError("no store: pass --store s3://bucket/prefix (or a local directory), or set HSX_STORE")
        style = addressing_style or recorded.get("addressing_style") or "auto"
        if style not in ("auto", "path", "virtual"):
            raise ConfigError(f"S3 addressing style must be auto, path or virtual, got {style!r}")
        endpoint_url = endpoint_url or recorded.get("endpoint_url")
        _endpoint_has_scheme(endpoint_url)
        settings = cls(url=url, endpoint_url=endpoint_url,
                       region=region or recorded.get("region"), addressing_style=style,
                       verify_etag=bool(recorded.get("verify_etag", True) if verify_etag is None else verify_etag),
                       checksums=checksums or recorded.get("checksums") or "when_required",
                       multipart_etag=multipart_etag or recorded.get("multipart_etag") or "auto",
                       integrity=integrity or recorded.get("integrity") or "auto")
        settings.quirks()  # a recorded value hsx does not know is a ConfigError naming its flag
        return settings

    def quirks(self):
        """The endpoint's quirks as hsx.store.quirks.EndpointQuirks; ConfigError naming the flag if one is wrong."""
        from hsx.store.quirks import EndpointQuirks, QuirkError

        try:
            return EndpointQuirks(self.addressing_style, self.checksums, self.multipart_etag, self.verify_etag,
                                  self.integrity)
        except QuirkError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def is_local(self) -> bool:
        return "://" not in self.url or self.url.startswith("file://")

    def check_writable(self) -> None:
        """A local store this user cannot write is an UnwritableDir now, before anything is created."""
        if self.is_local:
            from hsx.localdirs import check_writable

            check_writable(Path(self.url.removeprefix("file://")), "store", "--store / HSX_STORE")

    def open(self):
        from hsx.store import open_store  # the face: it imports this module

        return open_store(self.url, self.endpoint_url, self.region, self.quirks())

    def to_dict(self) -> dict:
        return asdict(self)
