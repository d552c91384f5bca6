"""The dashboard app: ``create_app(config)`` and ``serve(config)`` behind `hsx dashboard`.

One port serves the hsx page (/), its API (/api/...), /metrics, and
rq-dashboard (/rq: queues, workers, jobs), all behind the same optional auth
(dashboard.auth) and the same security headers (dashboard.headers).
"""

from __future__ import annotations

import logging
import signal
import sys

import redis
from flask import Flask

from dashboard import api, auth, firstview, headers, metrics, outage, pages, rq_mount
from dashboard.config import DashboardConfig
from dashboard.plan_cache import PlanCache
from dashboard.state import EXTENSION, AppState
from hsx import life
from hsx.redisconn import connect, redact

log = logging.getLogger(__name__)
RQ_PREFIX = rq_mount.PREFIX
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def create_app(config: DashboardConfig, r: redis.Redis | None = None) -> Flask:
    """The app for ``config``; ``r`` overrides the Redis client built from ``config.redis_url``."""
    life.rq_without_pickle()  # this process's entry: the app mounts rq-dashboard, which fetches jobs with rq's default
    app = Flask(__name__)
    app.json.sort_keys = False
    client = r or connect(config.redis_url, retries=3)
    app.extensions[EXTENSION] = AppState(config=config, redis=client, plans=PlanCache())
    auth.install(app, config)
    headers.install(app, RQ_PREFIX)
    outage.install(app, outage.RedisOutage(config.redis_url))
    firstview.install(app)
    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(metrics.bp)
    rq_mount.mount(app, config.redis_url, client, poll_ms=int(config.refresh_seconds * 1000))
    return app


def serve(config: DashboardConfig) -> int:
    """`hsx dashboard`: serve until Ctrl-C or SIGTERM; returns the exit code."""
    from werkzeug.serving import make_server

    if config.bind not in LOOPBACK and not config.auth_required:
        log.warning("serving on %s without auth: anyone who reaches this port can see the run and retry "
                    "batches; set HSX_DASHBOARD_TOKEN or HSX_DASHBOARD_USER + HSX_DASHBOARD_PASSWORD", config.bind)
    server = make_server(config.bind, config.port, create_app(config), threaded=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    host = f"[{config.bind}]" if ":" in config.bind else config.bind
    print(f"hsx dashboard on http://{host}:{server.server_port}/ (rq-dashboard at {RQ_PREFIX}/, "
          f"metrics at /metrics; Redis {redact(config.redis_url)}; "
          f"auth {'on' if config.auth_required else 'off'})", flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.server_close()
    return 0
