"""Issue 23 item 2: script planted in Redis never runs in the operator's browser.

Whoever can write to Redis plants markup where the dashboard renders Redis-sourced strings: a queue
name in ``rq:queues`` (/rq/), an rq worker hash's ``queues`` field (/rq/0/view/workers), a failed
job's description and ``exc_string`` (its job view and the failed-jobs list), a dead letter's error
and a run name (the hsx page). Each payload is ``<img src=x onerror=...>`` whose script, if it ran,
bumps ``window.__hsx_xss``, opens an alert and POSTs ``/api/retry`` for the run's dead letter (the
attack the issue reproduced). Headless Debian Chromium loads every page; the test asserts no script
ran (no dialog, no global, no request to /api/retry, the dead letter still there), that the payload
shows as text (the page works), that the hsx page raises no CSP violation, and that every page
carries the security headers.
"""

from __future__ import annotations

import base64
import shutil
import threading
import urllib.request
from datetime import datetime, timezone

import pytest
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from werkzeug.serving import make_server

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.life.ledger import BatchSpec
from tests.manifests import example_manifest
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS
from tests.waiting import scaled

RUN = "xss"
SPECS = [BatchSpec(batch_id=f"b{i:07d}", index=i, shard="00000", samples=2, tokens=10, padded=16, padded_len=8,
                   sample_ids=[f"s{i}-{j}" for j in range(2)]) for i in range(2)]
SCRIPT = ("window.__hsx_xss=(window.__hsx_xss||0)+1;alert('xss');"
          "fetch('/api/retry',{method:'POST',headers:{'Content-Type':'application/json'},body:'{\"run\":\"xss\"}'})")


def _payload() -> str:
    """``<img src=x onerror=eval(atob('...'))>``: no comma (rq splits a worker's queues on commas), no
    '/' or '+' (a queue name becomes a URL path), no space (an unquoted attribute)."""
    script = SCRIPT
    while True:
        encoded = base64.b64encode(script.encode()).decode()
        if not set(encoded) & {"/", "+"}:
            return f"<img src=x onerror=eval(atob('{encoded}'))>"
        script += " "


PAYLOAD = _payload()
EVIL_QUEUE = f"extract:{PAYLOAD}"
SECURITY_HEADERS = ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options", "Referrer-Policy")


def _plant(r) -> str:
    """Every payload in place; returns the failed job's id."""
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 2, "samples": 4, "tokens": 20})
    r.hset(RunKeys(RUN).dead, SPECS[0].batch_id, f'{{"attempts": 3, "last_error": "{PAYLOAD}", "ts": 1}}')
    r.sadd("hsx:runs", PAYLOAD)  # a run named with markup: the hsx page's run list
    Queue(EVIL_QUEUE, connection=r, serializer=JSONSerializer)  # no job needed: the name alone is listed
    r.sadd("rq:queues", f"rq:queue:{EVIL_QUEUE}")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    r.hset("rq:worker:evil-worker", mapping={"queues": PAYLOAD, "state": "idle", "birth": stamp,
                                             "last_heartbeat": stamp, "pid": 1})
    r.sadd("rq:workers", "rq:worker:evil-worker")
    job = Job.create("builtins.print", args=[], connection=r, serializer=JSONSerializer, id="evil-job",
                     description=PAYLOAD, origin="failedq")
    job.save()
    Result.create_failure(job, ttl=3600, exc_string=f"Traceback (most recent call last):\n{PAYLOAD}")
    FailedJobRegistry("failedq", connection=r, serializer=JSONSerializer).add(job, ttl=3600, exc_string=PAYLOAD)
    r.sadd("rq:queues", "rq:queue:failedq")
    return job.id


@pytest.fixture
def live_dashboard(r, redis_server):
    app = create_app(DashboardConfig(redis_url=redis_server.url, refresh_seconds=0.5), r)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(10)


def test_planted_markup_never_runs_in_a_real_browser(r, live_dashboard):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import expect, sync_playwright

    job_id = _plant(r)
    base = live_dashboard
    pages = {"/rq/": ("body", EVIL_QUEUE), "/rq/0/view/workers": ("body", PAYLOAD),
             f"/rq/0/view/job/{job_id}": ("body", PAYLOAD), "/rq/0/view/jobs/failedq/failed/8/asc/1": ("body", PAYLOAD),
             f"/?run={RUN}": ("#dead", PAYLOAD)}
    dialogs, retries, csp_errors = [], [], []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.on("request", lambda req: retries.append(req.url) if "/api/retry" in req.url else None)
        page.on("console", lambda m: csp_errors.append((page.url, m.text))
                if "Content Security Policy" in m.text else None)
        for path, (scope, shown) in pages.items():
            with page.expect_response(lambda res: "/data/" in res.url or "/api/status" in res.url, timeout=scaled(60) * 1000):
                page.goto(base + path)  # each view fills itself from one JSON endpoint
            page.wait_for_timeout(500)  # rendered, and an onerror fires as soon as the broken image is tried
            assert page.evaluate("window.__hsx_xss === undefined"), f"planted script ran on {path}"
            # The payload is on the page as text: the view rendered (under its CSP) and escaped it.
            expect(page.locator(scope).get_by_text(shown, exact=False).first).to_be_visible(timeout=scaled(60) * 1000)
        browser.close()
    assert not dialogs and not retries, (dialogs, retries)
    assert ledger.dead_letters(r, RUN), "a planted script retried the dead letter"
    hsx_page_violations = [m for url, m in csp_errors if "/rq" not in url]
    assert not hsx_page_violations, hsx_page_violations  # the hsx page runs whole under its strict CSP

    for path in [*pages, "/api/status", "/metrics", "/static/dashboard.js", "/rq/0/data/queues.json"]:
        with urllib.request.urlopen(base + path, timeout=scaled(30)) as res:
            missing = [h for h in SECURITY_HEADERS if not res.headers.get(h)]
            assert not missing, (path, missing)
            csp = res.headers["Content-Security-Policy"]
            assert "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
            assert res.headers["X-Frame-Options"] == "DENY" and res.headers["X-Content-Type-Options"] == "nosniff"
