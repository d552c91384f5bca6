"""`hsx dashboard`: the live web dashboard."""

from __future__ import annotations

from dashboard.config import DEFAULT_REFRESH_SECONDS, DEFAULT_STALE_AFTER_SECONDS, DashboardConfig
from hsx import defaults as D
from hsx.errors import ConfigError
from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, redis_url
from hsx_cli.flags import Flag, secret

FLAGS = (
    Flag("--bind", "address to bind", env="HSX_DASHBOARD_BIND", default=D.DEFAULT_DASHBOARD_HOST),
    Flag("--port", "port (0: any free port)", type=int, env="HSX_DASHBOARD_PORT", default=D.DEFAULT_DASHBOARD_PORT,
         min=0, max=65535),
    Flag("--refresh-seconds", "seconds between page refreshes in the browser", type=float,
         env="HSX_DASHBOARD_REFRESH_SECONDS", default=DEFAULT_REFRESH_SECONDS, min=0.5, max=3600),
    Flag("--stale-seconds", "seconds without a heartbeat before a worker is shown lost", type=float,
         env="HSX_DASHBOARD_STALE_SECONDS", default=float(DEFAULT_STALE_AFTER_SECONDS), above=0),
    Flag("--allowed-hosts", "extra Host names (comma-separated, no port) accepted for requests that change "
         "something; IP literals, localhost and --bind are always accepted", env="HSX_DASHBOARD_ALLOWED_HOSTS"),
    REDIS_URL,
)
SECRETS = "secrets come from the environment only: HSX_DASHBOARD_TOKEN, or HSX_DASHBOARD_USER + HSX_DASHBOARD_PASSWORD"


def config(v) -> DashboardConfig:
    return DashboardConfig(redis_url=redis_url(v), bind=v["bind"], port=v["port"],
                           token=secret("HSX_DASHBOARD_TOKEN"), user=secret("HSX_DASHBOARD_USER"),
                           password=secret("HSX_DASHBOARD_PASSWORD"), refresh_seconds=v["refresh_seconds"],
                           stale_after_seconds=v["stale_seconds"], allowed_hosts=v["allowed_hosts"] or ())


def run(cfg: DashboardConfig) -> int:
    try:
        from dashboard.app import serve
    except ImportError as exc:
        raise ConfigError(f"the dashboard is not available in this install ({exc}); pip install 'hsx[dashboard]'") from None

    return serve(cfg)


COMMAND = Command(
    "dashboard", "live web dashboard (with rq-dashboard at /rq)",
    "Serves the run overview (progress, rate, ETA, workers, hosts, dead letters, retry), its JSON API at /api, "
    "Prometheus metrics at /metrics and rq-dashboard at /rq, on one port. " + SECRETS + ".",
    FLAGS, config, run)
