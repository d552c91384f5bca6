"""The dashboard app: ``create_app(config)`` and ``serve(args)`` behind `hsx dashboard`.

One port serves the hsx page (/), its API (/api/...), /metrics, and
rq-dashboard (/rq: queues, workers, jobs), all behind the same optional auth
(dashboard.auth).
"""

from __future__ import annotations

import logging
import signal
import sys

import redis
from flask import Flask
from rq.serializers import JSONSerializer

from hsx.redisconn import connect, redact

from dashboard import api, auth, metrics, pages
from dashboard.config import DashboardConfig
from dashboard.plan_cache import PlanCache
from dashboard.state import EXTENSION, AppState

log = logging.getLogger(__name__)
RQ_PREFIX = "/rq"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _mount_rq_dashboard(app: Flask, config: DashboardConfig) -> None:
    import rq_dashboard
    from rq_dashboard import web as rq_web

    # rq-dashboard keeps its serializer in a module global; hsx jobs are JSON (never pickle).
    rq_web.config.serializer = JSONSerializer
    app.config["RQ_DASHBOARD_REDIS_URL"] = config.redis_url  # its pages show it with the password masked
    app.config["RQ_DASHBOARD_POLL_INTERVAL"] = int(config.refresh_seconds * 1000)
    rq_web.setup_rq_connection(app)
    app.register_blueprint(rq_dashboard.blueprint, url_prefix=RQ_PREFIX)


def create_app(config: DashboardConfig, r: redis.Redis | None = None) -> Flask:
    """The app for ``config``; ``r`` overrides the Redis client built from ``config.redis_url``."""
    app = Flask(__name__)
    app.json.sort_keys = False
    app.extensions[EXTENSION] = AppState(config=config, redis=r or connect(config.redis_url, retries=3),
                                         plans=PlanCache())
    auth.install(app, config)
    app.register_blueprint(pages.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(metrics.bp)
    _mount_rq_dashboard(app, config)
    return app


def serve(args) -> int:
    """`hsx dashboard`: serve until Ctrl-C or SIGTERM; returns the exit code."""
    from werkzeug.serving import make_server

    config = DashboardConfig.from_args(args)
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
