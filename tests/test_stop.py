"""A stop request ends every wait of a role at once (issue 31 item 5)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hsx import life
from hsx.life import batchlife, ledger
from hsx.life.ledger import BatchSpec
from tests.manifests import example_manifest
from tests.waiting import wait_until
from uploader.runtime import REFUSED_PAUSE_SECONDS


def test_sigterm_ends_an_uploaders_refusal_pause_at_once(tmp_path, r, redis_server):
    """An uploader set up with another --spool-dir than the host's workers puts the job back and pauses
    REFUSED_PAUSE_SECONDS (30 s); a SIGTERM in that pause used to wait it out (16-27 s to exit)."""
    spec = BatchSpec(batch_id="b0000000", index=0, shard="00000", samples=1, tokens=8, padded=8, padded_len=8,
                     sample_ids=["0"])
    ledger.save_plan(r, "st", example_manifest("st", store=str(tmp_path / "store")), [spec],
                     {"batches": 1, "samples": 1, "tokens": 8})
    worker_file = tmp_path / "spool-a" / "st" / "b0000000.safetensors"  # the workers' spool, not the uploader's
    batchlife.requeue_upload(r, "stophost", "st", "b0000000", str(worker_file), 8, "0" * 64, "disk")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsx_cli.main", "upload", "--spool-dir", str(tmp_path / "spool-b"), "--host", "stophost",
         "--memory-spool-dir", str(tmp_path / "shm"), "--heartbeat-seconds", "1"],
        env={**os.environ, "HSX_REDIS_URL": redis_server.url}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        wait_until("the uploader refuses the job", lambda: life.Run(r, "st").refused_uploads() or proc.poll() is not None, 120)
        assert proc.poll() is None, proc.communicate()[0]
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=3 * REFUSED_PAUSE_SECONDS)
        exit_seconds = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "uploads refused: spool mismatch on host stophost" in out, out
    # Well inside the pause (the process's own exit on this loaded machine takes the rest).
    assert exit_seconds < REFUSED_PAUSE_SECONDS / 2, (exit_seconds, out)
    assert proc.returncode == 0, out
    assert "uploader upload-stophost" in out or "batches uploaded" in out, out
