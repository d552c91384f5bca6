"""Issue 41 item 8: the page as served (no JavaScript) already shows the run, from what /api/status serves.

Was: index.html was a shell ("loading", empty tables) that dashboard.js filled; a plain fetch or a
screenshot without script showed nothing. A real redis-server holds a planned run mid-way (the
dashboard API test's ledger: 3 of 6 batches uploaded, a busy worker), plus a stopped and a lost worker
and a dead letter whose error and a run name carry markup; the page is fetched with the test client and
over plain HTTP, and read as HTML with the standard library's parser (no script runs).
"""

from __future__ import annotations

import threading
import urllib.request
from html.parser import HTMLParser

import redis
from werkzeug.serving import make_server

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import heartbeat
from hsx.life.keys import RunKeys
from tests.test_dashboard_api import AGE, RUN, mid_run
from tests.waiting import scaled

MARKUP = "<img src=x onerror=alert(1)>"
PASSWORD, TOKEN = "redis-pa55word", "dash-t0ken-secret"


class Page(HTMLParser):
    """Text by element id (an element's text includes its children's), and each element's attributes by id."""

    def __init__(self, html: str):
        super().__init__()
        self.text: dict[str, str] = {}
        self.attrs_by_id: dict[str, dict] = {}
        self.rows: dict[str, str] = {}  # data-worker / data-batch -> the row's text
        self._open: list[tuple[str, str | None]] = []  # (tag, id or row key)
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        key = a.get("id") or (f"worker:{a['data-worker']}" if "data-worker" in a else None) \
            or (f"batch:{a['data-batch']}" if "data-batch" in a else None)
        if key:
            self.attrs_by_id[key] = a
            self.text.setdefault(key, "")
        if tag not in ("meta", "link", "br", "input"):  # void elements: no end tag
            self._open.append((tag, key))

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        for _, key in self._open:
            if key:
                self.text[key] += data


def _plant(r) -> None:
    mid_run(r)
    heartbeat.publish_stopped(r, RUN, "gpu-hostB-0", {"host": "hostB", "device": "cuda:0", "gpu": 0, "batches": 1})
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostC-0", {"host": "hostC", "device": "cuda:0", "gpu": 0}, ttl_seconds=30)
    r.delete(RunKeys(RUN).heartbeat("gpu-hostC-0"))  # its heartbeat ran out, no goodbye: lost
    r.hset(RunKeys(RUN).dead, "b0005", f'{{"attempts": 3, "last_error": "boom {MARKUP}", "ts": 1}}')
    r.sadd("hsx:runs", MARKUP)  # a run named with markup, listed in the run selector


def _check(html: str) -> None:
    page = Page(html)
    assert "loading" not in page.text["run-state"] and page.text["run-state"] == "running, lost worker", page.text
    progress = {k: page.attrs_by_id[f"bar-{k}"] for k in ("samples", "tokens", "batches_extracted", "batches_uploaded")}
    assert {k: (a["data-done"], a["data-total"]) for k, a in progress.items()} == {
        "samples": ("30", "60"), "tokens": ("800", "2100"), "batches_extracted": ("4", "6"),
        "batches_uploaded": ("3", "6")}
    assert "30 / 60 (50.0%)" in page.text["bar-samples"] and "3 / 6 (50.0%)" in page.text["bar-batches_uploaded"]
    assert page.text["rate-samples"] == f"{30 / AGE:.1f} samples/s", page.text["rate-samples"]
    eta = 1300 / (800 / AGE)  # tokens left / token rate: ~3m15s
    assert page.text["eta"] in {f"{int(eta) // 60}m{s:02d}s" for s in range(int(eta) % 60 - 2, int(eta) % 60 + 3)}, \
        page.text["eta"]
    assert page.text["failure-count"] == "1 dead, 0 retrying"
    assert page.text["extract-queue"] == "1"
    workers = {k.removeprefix("worker:"): " ".join(v.split()) for k, v in page.text.items() if k.startswith("worker:")}
    assert set(workers) == {"gpu-hostA-0", "gpu-hostB-0", "gpu-hostC-0"}, workers
    assert "alive, busy" in workers["gpu-hostA-0"] and "NVIDIA H200" in workers["gpu-hostA-0"]
    assert " stopped " in workers["gpu-hostB-0"] and " lost " in workers["gpu-hostC-0"], workers
    assert page.attrs_by_id["worker:gpu-hostC-0"]["class"] == "lost"
    # the dead letter's error and the markup run name arrive as text, never as markup; secrets never arrive
    assert f"boom {MARKUP}" in page.text["batch:b0005"]
    assert MARKUP not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert PASSWORD not in html and TOKEN not in html
    assert page.text["shards"].count("/") >= 2 and "2 / 4" in page.text["shards"]
    assert "hidden" in page.attrs_by_id["empty"] and "hidden" in page.attrs_by_id["error"]


def test_the_served_page_shows_the_run_without_script(r, redis_server):
    _plant(r)
    url = redis_server.url.replace("redis://", f"redis://:{PASSWORD}@", 1)  # a password in the URL: redacted on the page
    app = create_app(DashboardConfig(redis_url=url, token=TOKEN), r=r)
    res = app.test_client().get(f"/?run={RUN}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert res.status_code == 200
    _check(res.get_data(as_text=True))
    assert res.headers["Content-Security-Policy"].startswith("default-src 'none'")

    server = make_server("127.0.0.1", 0, app, threaded=True)  # plain HTTP, as a screenshot tool fetches it
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/?run={RUN}",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=scaled(10)) as http:
            _check(http.read().decode())
    finally:
        server.shutdown()
        server.server_close()


def test_the_served_page_without_a_run_or_redis(r, redis_server):
    app = create_app(DashboardConfig(redis_url=redis_server.url), r=r)
    page = Page(app.test_client().get("/").get_data(as_text=True))
    assert "hidden" not in page.attrs_by_id["empty"] and "hsx produce" in page.text["empty"]
    assert page.text["run-state"] == "no run yet"
    page = Page(app.test_client().get("/?run=nope").get_data(as_text=True))
    assert page.text["error"] == "no run 'nope' in this Redis"

    nowhere = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    down = create_app(DashboardConfig(redis_url=nowhere), r=redis.Redis.from_url(nowhere, socket_connect_timeout=1))
    res = down.test_client().get("/")
    assert res.status_code == 200  # the page loads and names the outage; the script keeps retrying
    assert Page(res.get_data(as_text=True)).text["error"].startswith("Redis unreachable since")
