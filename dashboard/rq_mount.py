"""rq-dashboard mounted at /rq, read-only, on the app's own Redis client.

rq-dashboard is a blueprint that can also delete, requeue, empty and compact, and
that fetches jobs without a serializer (it would unpickle whatever a job hash
holds; ``create_app`` makes rq's default serializer JSON in this process first). Here:

- only the endpoints in READ_ONLY keep their view, and each only for GET/HEAD;
  every other endpoint of the blueprint (delete, requeue, requeue-all (which
  rq-dashboard also answers on GET), empty, compact, and any a later rq-dashboard
  adds) answers 403. The queue is a cache of the ledger in hsx: batches are
  retried through ``POST /api/retry`` or ``hsx retry-failed``, which keep the
  attempt count, never by rq's requeue;
- a job hash hsx did not write (bytes that are not JSON) shows as "not JSON" in
  the job lists and on the Workers page (rq-dashboard's two serialize functions
  are wrapped), and the one-job views answer 422 naming it, instead of a 500;
- a queue or registry entry that is not a valid rq job id (rq refuses to build a Job from it) shows as
  "not a valid rq job id" in the job lists (its Queue's ``fetch_job`` is wrapped), instead of a 500;
- rq-dashboard never sees the Redis URL: it uses the app's client (instance 0
  only), and the URL it displays is the redacted one;
- every string its JSON endpoints return (queue, worker and job names, a worker's
  queues, job descriptions, tracebacks, results, metadata) is HTML-escaped here:
  its client-side templates insert most of them as raw HTML (underscore's ``<%= %>``),
  so a queue named ``<img onerror=...>`` would otherwise run script in the
  operator's browser. The few fields its templates escape themselves (SELF_ESCAPED)
  are left alone while the mounted templates still do so (checked at mount), else
  escaped too. The CSP (dashboard.headers) is the second line.

The routes kept, all GET, all reading only (see docs/reliability.md, "Security"):
``/rq/`` and ``/rq/<0>/[view[/queues]]`` (queue overview), ``/rq/0/data/queues.json``
(queue depths and registry counts: counts only), ``/rq/0/view/workers`` and
``/rq/0/data/workers.json`` (workers and the job each holds, decoded as JSON),
``/rq/0/view/jobs[/...]`` and ``/rq/0/data/jobs/<queue>/<registry>/...json`` (job
lists), ``/rq/0/view/job/<id>`` and ``/rq/0/data/job/<id>.json`` (one job), and its
static files.
"""

from __future__ import annotations

import json
import logging
from functools import wraps

import redis
from flask import Flask, abort, current_app, request
from markupsafe import escape
from rq.exceptions import DeserializationError

from hsx.redisconn import redact

log = logging.getLogger(__name__)
BLUEPRINT = "rq_dashboard"
PREFIX = "/rq"
READ_ONLY = frozenset({
    "queues_overview", "workers_overview", "jobs_overview", "job_view",
    "list_queues", "list_workers", "list_jobs", "job_info", "static", "favicon",
})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
REFUSAL = ("read-only here: hsx keeps rq's queues as a cache of its ledger; retry dead letters with "
           "POST /api/retry (the page's retry button) or `hsx retry-failed`\n")


DATA_ENDPOINTS = frozenset({"list_queues", "list_workers", "list_jobs", "job_info"})  # JSON for its templates
# Fields an rq-dashboard template escapes itself (endpoint -> {field: text proving it, in that template}).
SELF_ESCAPED = {
    "list_jobs": ("rq_dashboard/jobs.html", {"description": "$('<div/>').text(d.description).html()",
                                             "exc_info": "$('<div/>').text(d.exc_info).html()"}),
    "list_workers": ("rq_dashboard/workers.html", {"description": "<%- d.current_job.description %>"}),
}
UNREADABLE_ERRORS = (DeserializationError, UnicodeDecodeError, json.JSONDecodeError, RecursionError)
NOT_JSON = "(job data is not JSON: hsx did not write it and does not decode it)"
INVALID_ID = "(not a valid rq job id: hsx did not write it)"


def _tolerant(serialize, placeholder):
    """rq-dashboard's per-job ``serialize``, giving ``placeholder(job)`` for a job that is not JSON."""

    @wraps(serialize)
    def wrapper(job):
        if isinstance(job, InvalidJobId):
            return placeholder(job)
        try:
            return serialize(job)
        except UNREADABLE_ERRORS as exc:
            log.warning("rq-dashboard: job %s holds data that is not JSON (%s)", getattr(job, "id", "?"),
                        type(exc).__name__)
            return placeholder(job)

    wrapper.hsx_tolerant = True
    return wrapper


class InvalidJobId:
    """What a job list holds for an id rq will not build a Job from (e.g. ``bad id!`` planted in a registry)."""

    def __init__(self, job_id: str):
        self.id = job_id


def _tolerant_queue(queue_class):
    """rq's Queue whose ``fetch_job`` gives an InvalidJobId for an id rq refuses, instead of raising."""

    class TolerantQueue(queue_class):
        def fetch_job(self, job_id):
            try:
                return super().fetch_job(job_id)
            except ValueError as exc:       # rq.job.validate_job_id
                log.warning("rq-dashboard: %r in queue %s is not a valid rq job id (%s)", job_id, self.name, exc)
                return InvalidJobId(job_id.decode(errors="replace") if isinstance(job_id, bytes) else str(job_id))

    TolerantQueue.hsx_tolerant = True
    return TolerantQueue


def _unreadable_job(job) -> dict:
    if isinstance(job, InvalidJobId):
        return {"id": job.id, "created_at": None, "started_at": None, "ended_at": None, "exc_info": None,
                "description": INVALID_ID}
    return {"id": job.id, "created_at": None, "started_at": None, "ended_at": None, "exc_info": None,
            "description": NOT_JSON}


def _unreadable_current_job(job) -> dict | str:
    return "idle" if job is None else {"job_id": job.id, "description": NOT_JSON, "created_at": None,
                                       "call_string": NOT_JSON}


def _refuse(**_view_args):
    return current_app.response_class(REFUSAL, status=403, mimetype="text/plain")


def _guarded(view):
    """The view, answering 422 (not 500) when a job hash holds bytes hsx did not write."""

    @wraps(view)
    def wrapper(**view_args):
        if request.method not in READ_METHODS:
            return _refuse()
        try:
            return view(**view_args)
        except UNREADABLE_ERRORS as exc:
            what = f"job {view_args['job_id']}" if "job_id" in view_args else "a job listed here"
            log.warning("rq-dashboard: %s holds data that is not JSON (%s: %s)", what, type(exc).__name__, exc)
            return current_app.response_class(f"{what} holds data that is not JSON: hsx did not write it and "
                                              "does not decode it\n", status=422, mimetype="text/plain")

    return wrapper


def escape_strings(value, keep: frozenset[str] = frozenset()):
    """``value`` (decoded JSON) with every string HTML-escaped, except the values of keys in ``keep``."""
    if isinstance(value, str):
        return str(escape(value))
    if isinstance(value, list):
        return [escape_strings(v, keep) for v in value]
    if isinstance(value, dict):
        return {k: v if k in keep and isinstance(v, str) else escape_strings(v, keep) for k, v in value.items()}
    return value


def self_escaped_fields(app: Flask, endpoint: str) -> frozenset[str]:
    """The fields of ``endpoint``'s JSON that its template (as mounted) escapes itself."""
    template, proofs = SELF_ESCAPED.get(endpoint, (None, {}))
    if template is None:
        return frozenset()
    source = app.jinja_env.loader.get_source(app.jinja_env, template)[0]
    return frozenset(field for field, proof in proofs.items() if proof in source)


def _escaping(view, keep: frozenset[str]):
    """The JSON view, its strings HTML-escaped (see the module doc)."""

    @wraps(view)
    def wrapper(**view_args):
        response = current_app.make_response(view(**view_args))
        if response.is_json and response.status_code == 200:
            response.set_data(json.dumps(escape_strings(response.get_json(), keep)))
        return response

    return wrapper


def mount(app: Flask, redis_url: str, r: redis.Redis, poll_ms: int) -> None:
    """Register rq-dashboard under PREFIX on ``app``, read-only, using ``r``."""
    import rq_dashboard
    from rq.serializers import JSONSerializer
    from rq_dashboard import web as rq_web

    rq_web.config.serializer = JSONSerializer  # where it does pass one (a module global of rq-dashboard)
    if not getattr(rq_web.serialize_job, "hsx_tolerant", False):  # module globals, looked up at call time
        rq_web.serialize_job = _tolerant(rq_web.serialize_job, _unreadable_job)
        rq_web.serialize_current_job = _tolerant(rq_web.serialize_current_job, _unreadable_current_job)
    if not getattr(rq_web.Queue, "hsx_tolerant", False):
        rq_web.Queue = _tolerant_queue(rq_web.Queue)
    app.config["RQ_DASHBOARD_REDIS_URL"] = (redact(redis_url),)   # shown on its pages; never used to connect
    app.config["RQ_DASHBOARD_POLL_INTERVAL"] = poll_ms
    app.config["RQ_DASHBOARD_DISABLE_DELETE"] = True              # hides its delete and empty buttons
    app.redis_conn = r                                            # where its views look for the connection
    app.register_blueprint(rq_dashboard.blueprint, url_prefix=PREFIX)

    def _one_instance():
        # Replaces rq-dashboard's own hook, which reconnects from the configured URL(s) per request.
        if (request.view_args or {}).get("instance_number", 0) != 0:
            abort(404)
        current_app.redis_conn = r

    app.before_request_funcs[BLUEPRINT] = [_one_instance]
    for name in {rule.endpoint for rule in app.url_map.iter_rules() if rule.endpoint.startswith(BLUEPRINT + ".")}:
        endpoint = name.partition(".")[2]
        view = app.view_functions[name]
        if endpoint in DATA_ENDPOINTS:
            view = _escaping(view, self_escaped_fields(app, endpoint))
        app.view_functions[name] = _guarded(view) if endpoint in READ_ONLY else _refuse
