"""Permanent store errors fail fast and show (issue 23 item 4).

moto's S3 behind tests/faultproxy.py: every request answered 403 AccessDenied,
or the answers stripped of the object's sha256 metadata so verification can
never pass. Before the fix both looped forever, shown only in the uploader log.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import ledger
from hsx.monitor.progress import run_progress, summary_lines
from hsx.runspec import spool
from hsx.runspec.config import StoreSettings
from hsx_tools.demo import sample_dataset
from producer.produce import produce
from tests.faultproxy import FaultProxy
from tests.pipeline import produce_config, worker_config


def _uploader_within(redis_url, spool_dir, seconds):
    """Run `hsx upload --burst`; fail (not hang) if it is still retrying after ``seconds``."""
    try:
        out = subprocess.run([sys.executable, "-m", "hsx_cli.main", "upload", "--spool-dir", str(spool_dir), "--host",
                              "testhost", "--burst", "--heartbeat-seconds", "1"], capture_output=True, text=True,
                             timeout=seconds, env={**os.environ, "HSX_REDIS_URL": redis_url})
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the uploader still retried after {seconds} s (a permanent error retried forever)") from None
    return out


@pytest.mark.parametrize("mode, words", [("forbidden", "AccessDenied"), ("strip_metadata", "sha256 metadata")])
def test_permanent_store_errors_dead_letter_and_show(r, redis_server, tiny_model, tmp_path, s3_server, s3_bucket,
                                                     mode, words):
    from gpu_worker.worker import run_worker

    proxy = FaultProxy(int(s3_server.rsplit(":", 1)[1]))
    proxy.set_mode("up")
    try:
        store = StoreSettings(url=f"s3://{s3_bucket}/runs", endpoint_url=proxy.url, region="us-east-1",
                              addressing_style="path")
        rows = tmp_path / "rows.jsonl"   # the sample's first 48 conversations: 9 batches, each refused twice
        rows.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:48]))
        produce(produce_config(redis_server.url, tiny_model, store, run="t1", dataset=rows, max_attempts=2))
        run_worker(worker_config(redis_server.url, tmp_path / "spool"))
        batches = ledger.run_totals(r, "t1")["batches"]
        proxy.set_mode(mode)
        out = _uploader_within(redis_server.url, tmp_path / "spool", 120)
        if mode == "forbidden":
            # An uploader that starts against a store refusing its credentials stops at its start check (issue 31
            # item 3): one line naming the credentials, exit 2, nothing counted against any batch, spool kept.
            assert out.returncode == 2 and "refused the credentials (bucket check: 403" in out.stderr
            assert not ledger.dead_letters(r, "t1") and not ledger.failures(r, "t1")
            assert len(spool.spool_files(tmp_path / "spool", "t1")) == batches
            return
    finally:
        proxy.stop()
    dead = ledger.dead_letters(r, "t1")
    assert len(dead) == batches and all(rec["attempts"] == 2 and words in rec["last_error"] for rec in dead.values())
    assert len(spool.spool_files(tmp_path / "spool", "t1")) == batches  # nothing deleted
    p = run_progress(r, "t1")
    assert words in p["store_refusal"]["error"]
    assert any(line.strip().startswith("STORE REFUSES") and words in line for line in summary_lines(p))
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    assert words in client.get("/api/status?run=t1").get_json()["overview"]["store_refusal"]["error"]
    page_js = client.get("/static/dashboard.js").get_data(as_text=True)
    assert "o.store_refusal" in page_js and 'id="problems"' in client.get("/?run=t1").get_data(as_text=True)
    assert 'hsx_store_refusing{run="t1"} 1.0' in client.get("/metrics").get_data(as_text=True)
    # Retried once the store takes uploads again: the kept spool files are uploaded, nothing is extracted again
    # (on main every one went back on the extract queue: 18 of 59 batches re-extracted in the report).
    from hsx.life import queues
    from hsx_cli.main import main

    assert main(["retry-failed", "--run", "t1", "--redis-url", redis_server.url]) == 0
    assert len(queues.queue(r, queues.extract_queue_name("t1"))) == 0
    upload_jobs = queues.queue(r, "upload@testhost").jobs
    assert sorted(j.kwargs["batch_id"] for j in upload_jobs) == sorted(dead)
    assert not r.hlen("hsx:t1:kept_uploads")
