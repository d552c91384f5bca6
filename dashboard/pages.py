"""The HTML page. It is a shell: dashboard.js fills it from /api/status every few seconds."""

from __future__ import annotations

from flask import Blueprint, render_template, request

from dashboard import state

bp = Blueprint("pages", __name__)


@bp.get("/")
def index():
    st = state.current()
    return render_template("index.html", run=request.args.get("run", ""), refresh_seconds=st.config.refresh_seconds)
