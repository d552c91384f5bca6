"""A Redis outage as the dashboard shows it: 503 "Redis unreachable since <time>", one log line each way.

While Redis does not answer, every request that needs it (the API, /metrics, rq-dashboard's data)
answers 503 with ``{"error": "Redis unreachable since 07:31:02 UTC (42 s): <reason>", "redis_down_since":
<unix time>}`` (plain text outside /api), and the page shows that line instead of an HTTP error. The log
gets one warning when the outage starts and one line when a request reads Redis again (with the
outage's length), never a traceback per request.
"""

from __future__ import annotations

import logging
import threading
import time

from flask import Flask, Response, current_app, jsonify, request
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from hsx.redisconn import redact

log = logging.getLogger(__name__)
EXTENSION = "hsx_outage"
# Endpoints whose success proves Redis answers (static files do not read it; the page reads it for its first view).
READS_REDIS = frozenset({"pages.index", "api.status", "api.runs", "metrics.metrics", "rq_dashboard.list_queues",
                         "rq_dashboard.list_workers", "rq_dashboard.list_jobs", "rq_dashboard.job_info"})


class RedisOutage:
    """When the current outage began (None: Redis answers); thread-safe, the server is threaded."""

    def __init__(self, redis_url: str):
        self.where = redact(redis_url)
        self._lock = threading.Lock()
        self.since: float | None = None

    def failed(self, exc: BaseException) -> float:
        """Note a request that could not reach Redis; returns when the outage began."""
        with self._lock:
            first = self.since is None
            if first:
                self.since = time.time()
            since = self.since
        if first:
            log.warning("Redis at %s unreachable (%s): answering 503 until it is back", self.where, _reason(exc))
        return since

    def answered(self) -> None:
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            log.warning("Redis at %s is back after %.0f s", self.where, time.time() - since)

    def message(self, since: float, exc: BaseException) -> str:
        stamp = time.strftime("%H:%M:%S UTC", time.gmtime(since))
        return f"Redis unreachable since {stamp} ({time.time() - since:.0f} s): {_reason(exc)}"


def _reason(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def current_outage() -> RedisOutage:
    """The app's outage record (for a view that catches the Redis error itself, as the page does)."""
    return current_app.extensions[EXTENSION]


def install(app: Flask, outage: RedisOutage) -> None:
    app.extensions[EXTENSION] = outage

    @app.errorhandler(RedisConnectionError)
    @app.errorhandler(RedisTimeoutError)
    def _redis_down(exc):
        since = outage.failed(exc)
        text = outage.message(since, exc)
        if request.path.startswith("/api/"):
            response = jsonify({"error": text, "redis_down_since": since})
            response.status_code = 503
        else:
            response = Response(text + "\n", status=503, mimetype="text/plain")
        response.headers["Retry-After"] = "5"
        return response

    @app.after_request
    def _redis_answered(response):
        if outage.since is not None and request.endpoint in READS_REDIS and response.status_code < 500:
            outage.answered()
        return response
