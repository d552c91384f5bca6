"""Optional access control for every route of the app (page, API, retry, /metrics, /rq).

With neither HSX_DASHBOARD_TOKEN nor HSX_DASHBOARD_USER set, everything is
open: the server binds 127.0.0.1 by default, so only this host (or an SSH
tunnel) reaches it. With a token, a request passes with
``Authorization: Bearer <token>``, with the cookie set by opening any page
once as ``?token=<token>`` (then redirected to the same URL without it), or,
with basic auth configured, with the right user and password. Unsafe methods
(POST, ...) from another origin are refused whatever the credentials: a
cross-site form must not retry or delete jobs with the operator's cookie.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlencode, urlsplit

from flask import Flask, Response, redirect, request

from dashboard.config import DashboardConfig

TOKEN_COOKIE = "hsx_dashboard_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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


def _cross_origin() -> bool:
    origin = request.headers.get("Origin")
    return bool(origin) and urlsplit(origin).netloc != request.host


def install(app: Flask, config: DashboardConfig) -> None:
    @app.before_request
    def _guard():
        if request.method not in SAFE_METHODS and _cross_origin():
            return Response("cross-origin request refused\n", status=403, mimetype="text/plain")
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
