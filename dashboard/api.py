"""JSON API: /api/status (the page's numbers), /api/runs, and the dead-letter retry action.

``GET /api/status?run=R`` -> ``{"runs": [...], "refresh_seconds": s, "redis": <redacted url>, "overview": {...}}``
with ``overview`` from ``dashboard.overview.build_overview`` (null when Redis holds no run yet);
404 for a run Redis does not know.
``POST /api/retry`` with JSON ``{"run": R, "batch_ids": [...]}`` (omit batch_ids: all dead letters)
-> ``{"run": R, "retried": [...]}``: dead letters go back onto the extract queue.
"""

from __future__ import annotations

from flask import Blueprint, abort, jsonify, request

from dashboard import state
from dashboard.overview import build_overview, pick_run
from hsx import life
from hsx.redisconn import redact

bp = Blueprint("api", __name__, url_prefix="/api")


@bp.after_request
def _no_cache(response):
    response.headers["Cache-Control"] = "no-store"
    return response


@bp.get("/runs")
def runs():
    return jsonify({"runs": life.Run.names(state.current().redis)})


@bp.get("/status")
def status():
    st = state.current()
    requested = request.args.get("run") or None
    run, runs = pick_run(st.redis, requested)
    if requested and run is None:
        abort(404, description=f"no run {requested!r} in this Redis")
    overview = build_overview(st.redis, run, st.config, st.plans) if run else None
    return jsonify({"runs": runs, "refresh_seconds": st.config.refresh_seconds, "redis": redact(st.config.redis_url),
                    "overview": overview})


@bp.post("/retry")
def retry():
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or not isinstance(body.get("run"), str):
        abort(400, description='send JSON {"run": "<run>", "batch_ids": [...]} (batch_ids optional: all dead letters)')
    st = state.current()
    run, bids = body["run"], body.get("batch_ids")
    if run not in life.Run.names(st.redis):
        abort(404, description=f"no run {run!r} in this Redis")
    if bids is not None and (not isinstance(bids, list) or not all(isinstance(b, str) for b in bids)):
        abort(400, description="batch_ids must be a list of batch id strings")
    ledger = life.Run(st.redis, run)
    if bids is not None:
        known = ledger.dead_letters()
        bids = [b for b in bids if b in known]
        if not bids:
            return jsonify({"run": run, "retried": []})
    return jsonify({"run": run, "retried": sorted(ledger.retry(bids))})


@bp.errorhandler(400)
@bp.errorhandler(404)
def _json_error(exc):
    return jsonify({"error": exc.description}), exc.code
