"""The dashboard's frozen configuration (built by `hsx dashboard` from its flags: hsx_cli/dashboard.py).

Secrets (the access token, the basic-auth password, a Redis password inside the
URL) come from the environment only and are never rendered, logged or returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hsx import defaults as D
from hsx.errors import ConfigError

DEFAULT_REFRESH_SECONDS = 3.0        # seconds between page/API refreshes in the browser
DEFAULT_STALE_AFTER_SECONDS = D.DEFAULT_HEARTBEAT_TTL_SECONDS  # seconds without heartbeat -> worker shown "lost"
DEFAULT_SERIES_SPAN_SECONDS = 1800   # seconds of history in the throughput chart (at most)
DEFAULT_SERIES_BUCKET_SECONDS = 10   # seconds a chart bucket
DEFAULT_RECENT_ERRORS = 20           # failures shown under "recent errors"


def parse_hosts(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Host names from "a.example, b.example" (or a sequence): lower case, no port or trailing dot."""
    items = value.split(",") if isinstance(value, str) else value
    names = []
    for item in items:
        name = item.strip().lower().rstrip(".")
        if not name:
            continue
        if "/" in name or ":" in name:  # IP addresses need no entry: every IP literal is accepted
            raise ConfigError(f"HSX_DASHBOARD_ALLOWED_HOSTS takes host names without scheme or port, got {item.strip()!r}")
        names.append(name)
    return tuple(names)


@dataclass(frozen=True)
class DashboardConfig:
    redis_url: str
    bind: str = D.DEFAULT_DASHBOARD_HOST
    port: int = D.DEFAULT_DASHBOARD_PORT
    token: str | None = field(default=None, repr=False)      # HSX_DASHBOARD_TOKEN: bearer / ?token= / cookie
    user: str | None = None                                  # HSX_DASHBOARD_USER: HTTP basic auth
    password: str | None = field(default=None, repr=False)   # HSX_DASHBOARD_PASSWORD
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS
    stale_after_seconds: float = DEFAULT_STALE_AFTER_SECONDS
    series_span_seconds: int = DEFAULT_SERIES_SPAN_SECONDS
    series_bucket_seconds: int = DEFAULT_SERIES_BUCKET_SECONDS
    allowed_hosts: tuple[str, ...] = ()   # HSX_DASHBOARD_ALLOWED_HOSTS: extra Host names accepted for changes

    def __post_init__(self):
        object.__setattr__(self, "allowed_hosts", parse_hosts(self.allowed_hosts))
        if bool(self.user) != bool(self.password):
            raise ConfigError("basic auth needs both HSX_DASHBOARD_USER and HSX_DASHBOARD_PASSWORD")

    @property
    def auth_required(self) -> bool:
        return bool(self.token or self.user)
