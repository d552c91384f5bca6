"""Security headers on every response of the app (the hsx page, its API, /metrics and /rq).

- ``Content-Security-Policy``: scripts only from this origin (the hsx page has no inline script:
  dashboard.js is a static file), no inline event handlers, no plugins, no ``<base>``, forms post
  only here, no framing. rq-dashboard's pages (/rq) keep one inline ``<script>`` of their own and
  compile their underscore templates with ``new Function``: those pages get a fresh nonce a
  response (written into their ``<script>`` tags here) and ``'unsafe-eval'``; inline event handlers
  (``<img onerror=...>``) stay blocked there too. Redis-sourced strings are escaped before they
  reach those templates (dashboard.rq_mount), the CSP is the second line.
- ``X-Frame-Options: DENY`` (and ``frame-ancestors 'none'``): no clickjacking of the retry button.
- ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer``,
  ``Cross-Origin-Opener-Policy: same-origin``.
"""

from __future__ import annotations

import re
import secrets

from flask import Flask, Response, request

HSX_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
           "font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
# rq-dashboard: its inline script by nonce, its templates by eval; style attributes in its markup.
RQ_CSP = ("default-src 'none'; script-src 'self' 'nonce-{nonce}' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
          "img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
          "frame-ancestors 'none'")
FIXED = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
         "Cross-Origin-Opener-Policy": "same-origin"}
_SCRIPT_TAG = re.compile(rb"<script(?=[\s>])", re.IGNORECASE)


def _with_nonce(response: Response) -> str:
    """Write a fresh nonce into every ``<script`` tag of an HTML response; return it. Only rq-dashboard's
    Jinja templates are served this way, and Jinja escapes ``<`` in every value it renders, so the tags
    found are the template's own."""
    nonce = secrets.token_urlsafe(16)
    body = response.get_data()
    response.set_data(_SCRIPT_TAG.sub(b'<script nonce="' + nonce.encode() + b'"', body))
    return nonce


def install(app: Flask, rq_prefix: str) -> None:
    @app.after_request
    def _security_headers(response: Response) -> Response:
        csp = HSX_CSP
        if request.path.startswith(rq_prefix + "/") and response.mimetype == "text/html" and not response.direct_passthrough:
            csp = RQ_CSP.format(nonce=_with_nonce(response))
        response.headers["Content-Security-Policy"] = csp
        response.headers.update(FIXED)
        return response
