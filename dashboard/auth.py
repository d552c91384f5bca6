"""Access control for every route of the app (page, API, retry, /metrics, /rq).

With neither HSX_DASHBOARD_TOKEN nor HSX_DASHBOARD_USER set, reading is open:
the server binds 127.0.0.1 by default, so only this host (or an SSH tunnel)
reaches it. With a token, a request passes with ``Authorization: Bearer <token>``,
with the cookie set by opening any page once as ``?token=<token>`` (then
redirected to the same URL without it; the access log never shows the token),
or, with basic auth configured, with the right user and password.

State-changing requests (every method but GET/HEAD/OPTIONS) pass only when,
whatever the credentials:
- the Host header names this dashboard: an IP address, ``localhost``, the bound
  address, or a name in HSX_DASHBOARD_ALLOWED_HOSTS. A DNS-rebinding page (its own
  name pointed at 127.0.0.1) sends its own name as Host and is refused;
- the Origin header, when sent (browsers send it on every cross-origin request and
  every POST), is this same host and port, and Sec-Fetch-Site is not cross-site:
  a cross-site form must not retry jobs with the operator's cookie.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from urllib.parse import urlencode, urlsplit

from flask import Flask, Response, redirect, request

from dashboard.config import DashboardConfig

TOKEN_COOKIE = "hsx_dashboard_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ALWAYS_ALLOWED_HOSTS = frozenset({"localhost"})
# A query parameter holding a secret, as it appears in a logged request line.
_SECRET_IN_URL = re.compile(r"(?i)([?&;][^&;=\s\"]*(?:token|password|secret)[^&;=\s\"]*)=[^&;\s\"]*")


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def _authorised(config: DashboardConfig) -> bool:
    if config.token:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and _same(header[7:].strip(), config.token):
            return True
        if _same(request.cookies.get(TOKEN_COOKIE), config.token):
            return True
    if config.user:
        auth = request.authorization
        if auth and auth.type == "basic" and _same(auth.username, config.user) and _same(auth.password, config.password):
            return True
    return False


def split_host(host: str) -> tuple[str, str]:
    """(name, port) of a Host header value or an Origin's netloc: name lower case, without brackets or
    trailing dot; port "" when absent."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest.removeprefix(":")
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name.rstrip("."), port
    return host.rstrip("."), ""


def host_name(host: str) -> str:
    return split_host(host)[0]


def host_allowed(host: str, config: DashboardConfig) -> bool:
    """Whether a Host header names this dashboard (see the module doc)."""
    name = host_name(host)
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True  # a page can only send an IP as Host from an origin that is that IP: no rebinding
    except ValueError:
        pass
    return name in ALWAYS_ALLOWED_HOSTS or name == host_name(config.bind) or name in config.allowed_hosts


def state_change_refusal(config: DashboardConfig) -> str | None:
    """Why this unsafe request must be refused, or None."""
    if not host_allowed(request.host, config):
        return (f"Host {host_name(request.host)!r} is not a name of this dashboard; add it to "
                "HSX_DASHBOARD_ALLOWED_HOSTS (comma-separated) to accept changes made through it")
    origin = request.headers.get("Origin")
    if origin is not None and (origin == "null" or split_host(urlsplit(origin).netloc) != split_host(request.host)):
        return "cross-origin request refused"
    if request.headers.get("Sec-Fetch-Site") == "cross-site":
        return "cross-site request refused"
    return None


class SecretsFilter(logging.Filter):
    """Masks secret query parameters (?token=...) and the given secret values in log records."""

    MIN_LENGTH = 8  # shorter values are not searched for: masking every "ab" would garble the log

    def __init__(self, secrets: tuple[str, ...] = ()):
        super().__init__("hsx-secrets")
        self.secrets = tuple(s for s in secrets if s and len(s) >= self.MIN_LENGTH)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = _SECRET_IN_URL.sub(r"\1=***", message)
        for secret in self.secrets:
            clean = clean.replace(secret, "***")
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def hide_secrets_in_access_log(config: DashboardConfig) -> None:
    """Install SecretsFilter on werkzeug's logger (its access log line quotes the request URL)."""
    logger = logging.getLogger("werkzeug")
    for old in [f for f in logger.filters if isinstance(f, SecretsFilter)]:
        logger.removeFilter(old)
    logger.addFilter(SecretsFilter((config.token or "", config.password or "")))


def install(app: Flask, config: DashboardConfig) -> None:
    hide_secrets_in_access_log(config)

    @app.before_request
    def _guard():
        if request.method not in SAFE_METHODS:
            refusal = state_change_refusal(config)
            if refusal:
                return Response(refusal + "\n", status=403, mimetype="text/plain")
        if not config.auth_required:
            return None
        offered = request.args.get("token")
        if config.token and offered is not None and _same(offered, config.token):
            rest = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
            response = redirect(request.path + (f"?{urlencode(rest)}" if rest else ""))
            response.set_cookie(TOKEN_COOKIE, config.token, httponly=True, samesite="Strict")
            return response
        if _authorised(config):
            return None
        response = Response("authentication required\n", status=401, mimetype="text/plain")
        if config.user:
            response.headers["WWW-Authenticate"] = 'Basic realm="hsx dashboard", charset="UTF-8"'
        return response
