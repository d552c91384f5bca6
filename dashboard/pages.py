"""The HTML page: its first view rendered on the server (dashboard.firstview), then dashboard.js takes over,
redrawing it from /api/status every few seconds."""

from __future__ import annotations

from flask import Blueprint, render_template, request

from dashboard import state
from dashboard.firstview import first_view

bp = Blueprint("pages", __name__)


@bp.get("/")
def index():
    st = state.current()
    return render_template("index.html", refresh_seconds=st.config.refresh_seconds,
                           **first_view(request.args.get("run") or None))
