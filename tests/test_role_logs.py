"""Logs a person can follow: worker and uploader log progress lines (rate, totals, spool, queue) and a summary on exit."""

from __future__ import annotations

import logging
import re

from hsx.keys import RunKeys
from producer.produce import produce
from tests.pipeline import produce_config, upload_config, worker_config


def test_worker_and_uploader_log_progress_and_an_exit_summary(r, redis_server, tiny_model, tmp_path, caplog):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="logs"))
    batches = int(r.hget(RunKeys("logs").totals, "batches"))
    with caplog.at_level(logging.INFO):
        run_worker(worker_config(redis_server.url, tmp_path / "spool", run="logs", log_every_seconds=0.5,
                                 min_batch_seconds=0.2))
        run_uploader(upload_config(redis_server.url, tmp_path / "spool", log_every_seconds=0.5))
    worker_lines = [m for m in caplog.messages if m.startswith("worker gpu-testhost-logs:")]
    upload_lines = [m for m in caplog.messages if m.startswith("uploader upload-testhost:")]
    assert len(worker_lines) >= 2, caplog.messages  # at least one while running (per interval) + the summary
    assert re.search(rf"^worker gpu-testhost-logs: {batches} batches, \d+ tokens in \d+s \(\d+ tokens/s, "
                     rf"[\d.]+ batches/min\), {batches} spooled \([\d.]+ [KMG]?B\); spool \d+ files .* of .* \(.*\); extract:logs queue 0$",
                     worker_lines[-1]), worker_lines[-1]
    assert re.search(rf"^uploader upload-testhost: {batches} batches, .* uploaded \(.*/s\), 0 failed tries; "
                     r"spool 0 files .*; upload@testhost queue 0$", upload_lines[-1]), upload_lines
