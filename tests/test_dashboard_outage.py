"""Issue 20 item 2, the dashboard's part: during a Redis outage the page says "Redis unreachable since
<time>" (was: "HTTP 500 from /api/status"), the API and /metrics answer 503 naming the outage, and the
log has one line when it starts and one when Redis is back (was: a traceback per request).

A private redis-server of this test's own is stopped and started again on the same port; the dashboard
runs in this process on a real socket and headless Chromium watches its page.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time

import pytest
from werkzeug.serving import make_server

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import ledger
from hsx.life.ledger import BatchSpec
from hsx.redisconn import LocalRedis, connect
from tests.manifests import example_manifest
from tests.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS
from tests.waiting import scaled

RUN = "out"
SPECS = [BatchSpec(batch_id="b0000000", index=0, shard="00000", samples=2, tokens=10, padded=16, padded_len=8,
                   sample_ids=["s0", "s1"])]


def test_a_redis_outage_is_one_line_on_the_page_and_two_in_the_log(tmp_path, caplog):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import expect, sync_playwright

    redis_server = LocalRedis(tmp_path / "redis").start()
    server = None
    try:
        ledger.save_plan(connect(redis_server.url), RUN, example_manifest(RUN), SPECS, {"batches": 1})
        app = create_app(DashboardConfig(redis_url=redis_server.url, refresh_seconds=1.0))
        client = app.test_client()
        assert client.get(f"/api/status?run={RUN}").status_code == 200
        server = make_server("127.0.0.1", 0, app, threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_port}"
        caplog.set_level(logging.INFO)

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page()
            page.goto(f"{base}/?run={RUN}")
            expect(page.locator("#bar-batches_uploaded")).to_have_attribute("data-total", "1", timeout=scaled(60) * 1000)

            redis_server.stop()
            expect(page.locator("#error")).to_contain_text("Redis unreachable since", timeout=scaled(60) * 1000)
            assert "HTTP 500" not in page.locator("#error").inner_text()
            for _ in range(3):
                res = client.get(f"/api/status?run={RUN}")
                assert res.status_code == 503 and res.json["error"].startswith("Redis unreachable since"), res.data
                assert res.json["redis_down_since"] <= time.time()
            metrics = client.get("/metrics")
            assert metrics.status_code == 503 and metrics.data.startswith(b"Redis unreachable since")

            redis_server.start()
            expect(page.locator("#error")).to_be_hidden(timeout=scaled(60) * 1000)
            browser.close()
        assert client.get(f"/api/status?run={RUN}").status_code == 200
    finally:
        if server is not None:
            server.shutdown()
        redis_server.stop()

    ours = [rec for rec in caplog.records if rec.name.startswith("dashboard")]
    down = [rec.getMessage() for rec in ours if "unreachable" in rec.getMessage()]
    back = [rec.getMessage() for rec in ours if "is back after" in rec.getMessage()]
    assert len(down) == 1 and len(back) == 1, [rec.getMessage() for rec in ours]
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
