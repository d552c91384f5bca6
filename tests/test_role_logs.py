"""Logs a person can follow: worker and uploader log progress lines (rate, totals, spool, queue) and a summary on exit."""

from __future__ import annotations

import logging
import re

from hsx.life.keys import RunKeys
from hsx.monitor.progress import fmt_bytes
from producer.produce import produce
from tests.pacedworker import paced_extractor
from tests.pipeline import produce_config, upload_config, worker_config


def test_worker_and_uploader_log_progress_and_an_exit_summary(r, redis_server, tiny_model, tmp_path, caplog, monkeypatch):
    from gpu_worker import worker
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="logs"))
    batches = int(r.hget(RunKeys("logs").totals, "batches"))
    with caplog.at_level(logging.INFO):
        monkeypatch.setattr(worker, "Extractor", paced_extractor(0.2))
        rt = run_worker(worker_config(redis_server.url, tmp_path / "spool", run="logs", log_every_seconds=0.5))
        up = run_uploader(upload_config(redis_server.url, tmp_path / "spool", log_every_seconds=0.5))
    worker_lines = [m for m in caplog.messages if m.startswith("worker gpu-testhost-logs:")]
    upload_lines = [m for m in caplog.messages if m.startswith("uploader upload-testhost:")]
    assert len(worker_lines) >= 2, caplog.messages  # at least one while running (per interval) + the summary
    assert re.search(rf"^worker gpu-testhost-logs: {batches} batches, \d+ tokens in \d+s; last \d+s: \d+ tokens/s, "
                     rf"[\d.]+ batches/min; {batches} spooled \([\d.]+ [KMG]?B\); spool \d+ files .* of .* \(.*\); extract:logs queue 0$",
                     worker_lines[-1]), worker_lines[-1]
    assert re.search(rf"^uploader upload-testhost: {batches} batches, .* uploaded; last \d+s: [\d.]+ batches/min, "
                     r".*/s; 0 failed tries; "
                     r"spool 0 files .*; upload@testhost queue 0$", upload_lines[-1]), upload_lines

    assert [m for m in caplog.messages if m.startswith("ready: ")] == [
        f"ready: model {tiny_model} loaded on cpu, taking jobs from extract:logs as gpu-testhost-logs",
        f"ready: uploader upload-testhost taking jobs from upload@testhost, spool {tmp_path / 'spool'}"]

    # Idle after the run: rates are over the last interval (0, not a lifetime average), and a complete run
    # gets one "complete, idle" line instead of a progress line every interval.
    rt._logged_at -= 30
    assert re.search(r"; last 3\ds: 0 tokens/s, 0.0 batches/min; ", rt.progress_line()), rt.progress_line()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            rt.log_progress()
            up.log_progress()
    assert caplog.messages == [
        "run logs complete, idle: worker gpu-testhost-logs waits for jobs on extract:logs",
        f"idle: uploader upload-testhost has uploaded {batches} batches ({fmt_bytes(up.bytes)}); upload@testhost is "
        "empty, waiting for jobs"]
