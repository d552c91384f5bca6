"""A real browser on a live `hsx dashboard` during a small real run.

The dashboard, a CPU worker and an uploader run as real `hsx` subprocesses
against a private redis-server; headless Debian Chromium (through Playwright)
loads the page, watches the bars and numbers advance to the finished run,
opens /rq, and saves screenshots under test-artifacts/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hsx.redisconn import free_port
from tests.pacedworker import PACED_HSX
from tests.pipeline import produce_config
from tests.waiting import ProgressDeadline, scaled

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
RUN = "live"
IDLE_SECONDS = 90   # the run must show progress at least this often...
CAP_SECONDS = 480   # ...and finish within this (27 batches on the tiny model: ~20 s on a quiet machine)


def _hsx() -> list[str]:
    script = Path(sys.executable).with_name("hsx")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hsx_cli.main"]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> dict:
    """The JSON at ``url`` once the server answers (within ``scaled(timeout)``); fails at once if ``proc`` (the
    server) exits."""
    deadline = time.monotonic() + scaled(timeout)
    while True:
        try:
            with urllib.request.urlopen(url, timeout=scaled(5)) as res:
                return json.load(res)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _log_sizes(logs: Path) -> tuple[int, ...]:
    return tuple(p.stat().st_size for p in sorted(logs.glob("*.log")))


def _bar(page, key: str) -> tuple[int, int]:
    row = page.locator(f"#bar-{key}")
    return int(row.get_attribute("data-done")), int(row.get_attribute("data-total"))


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=scaled(10))
            except subprocess.TimeoutExpired:
                proc.kill()


def test_page_follows_a_real_run(r, redis_server, tiny_model, tmp_path, artifacts, procs):
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is not installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import expect, sync_playwright

    from producer.produce import produce

    for old in ("dashboard-running.png", "dashboard-finished.png", "dashboard-rq.png"):
        (artifacts / old).unlink(missing_ok=True)
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=RUN))
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url, "HSX_DASHBOARD_REFRESH_SECONDS": "0.5",
           "HSX_TEST_MIN_BATCH_SECONDS": "0.3", "HSX_HOST": "testhost"}
    for secret in ("HSX_DASHBOARD_TOKEN", "HSX_DASHBOARD_USER", "HSX_DASHBOARD_PASSWORD"):
        env.pop(secret, None)
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()

    def spawn(name: str, *args: str) -> subprocess.Popen:
        with open(logs / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
            command = PACED_HSX if args[0] == "worker" else _hsx()  # the worker's batches last 0.3 s
            proc = subprocess.Popen([*command, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    dashboard = spawn("dashboard", "dashboard", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    # Start-up imports torch and rq: seconds on a quiet machine, a minute or more on a loaded one.
    assert _wait_http(f"{base}/api/status?run={RUN}", dashboard, 180)["overview"]["progress"]["batches_uploaded"]["done"] == 0

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        page.goto(f"{base}/?run={RUN}")
        expect(page.locator("#bar-batches_uploaded")).to_have_attribute("data-total", "27", timeout=scaled(60) * 1000)
        assert _bar(page, "batches_extracted")[0] == 0 and _bar(page, "samples") == (0, 160)
        expect(page.locator("#shards tbody tr")).to_have_count(7)

        spool = str(tmp_path / "spool")
        worker = spawn("worker", "worker", "--run", RUN, "--device", "cpu", "--burst", "--spool-dir", spool,
                       "--heartbeat-seconds", "0.5", "--name", "gpu-testhost-cpu")
        spawn("uploader", "upload", "--spool-dir", spool, "--heartbeat-seconds", "0.5")

        # Poll what the browser shows (never the API directly) until the run is complete; give up only
        # when neither the page nor the roles' logs (model loading, first batches) moved for IDLE_SECONDS:
        # a loaded machine is slow, not stuck.
        seen_extracted, seen_samples, saw_worker_row = [], [], False
        deadline = ProgressDeadline(IDLE_SECONDS, CAP_SECONDS)
        while not deadline.expired((seen_extracted[-1:], seen_samples[-1:], *_log_sizes(logs))):
            seen_extracted.append(_bar(page, "batches_extracted")[0])
            seen_samples.append(_bar(page, "samples")[0])
            saw_worker_row = saw_worker_row or page.locator('#workers tr[data-worker="gpu-testhost-cpu"]').count() > 0
            if 0 < seen_extracted[-1] < 27 and not (artifacts / "dashboard-running.png").exists():
                page.screenshot(path=str(artifacts / "dashboard-running.png"), full_page=True)
            if page.locator("#run-state").inner_text().startswith("complete"):
                break
            assert worker.poll() in (None, 0), (logs / "worker.log").read_text()[-3000:]
            time.sleep(0.3)

        assert page.locator("#run-state").inner_text().startswith("complete"), f"{deadline}; {seen_extracted}"
        assert seen_extracted == sorted(seen_extracted) and seen_samples == sorted(seen_samples)  # never back
        assert len({x for x in seen_extracted if 0 < x < 27}) >= 2, seen_extracted  # advanced step by step
        assert saw_worker_row
        assert _bar(page, "batches_uploaded") == (27, 27) and _bar(page, "samples") == (160, 160)
        assert page.locator("#bar-tokens .bar > span").evaluate("e => e.style.width") == "100%"
        assert page.locator("#eta").inner_text() == "done"
        assert page.locator("#shards tbody tr td.num").all_inner_texts() == ["4 / 4"] * 6 + ["3 / 3"]
        assert page.locator("#chart polyline.uploaded").count() == 1
        assert page.locator("#error").is_hidden()
        page.screenshot(path=str(artifacts / "dashboard-finished.png"), full_page=True)

        page.goto(f"{base}/rq/")
        expect(page.get_by_text(f"extract:{RUN}").first).to_be_visible(timeout=scaled(60) * 1000)
        page.screenshot(path=str(artifacts / "dashboard-rq.png"), full_page=True)
        browser.close()
    assert (artifacts / "dashboard-finished.png").stat().st_size > 10_000
