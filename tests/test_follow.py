"""Follow mode against a real running pipeline: a worker and an uploader run as processes while the test,
as a trainer would, reads the run through RunFollower; it starts before the run is complete, stops halfway
(a trainer crash), resumes from the saved cursor, and ends when the run is COMPLETE."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from hsx.redisconn import text
from hsx.run import ledger
from hsx.run.keys import RunKeys
from hsx_reader import Cursor, ReaderError, RunDataset, RunFollower, collate_packed
from hsx_tools.processes import stop_all
from producer.produce import produce
from tests.pipeline import produce_config, run_pipeline

RUN = "follow"


def _roles(env, spool, logs):
    common = ["--spool-dir", str(spool), "--host", "followhost", "--heartbeat-seconds", "1"]
    worker = subprocess.Popen([sys.executable, "-m", "hsx_cli.main", "worker", "--run", RUN, "--device", "cpu",
                               "--burst", *common], env=env, stdout=open(logs / "worker.log", "w"), stderr=subprocess.STDOUT)
    uploader = subprocess.Popen([sys.executable, "-m", "hsx_cli.main", "upload", *common], env=env,
                                stdout=open(logs / "upload.log", "w"), stderr=subprocess.STDOUT)
    return [worker, uploader]


def _stop(procs):
    stop_all(procs)


@pytest.mark.slow
def test_trainer_follows_a_running_extraction_and_resumes_from_its_cursor(r, redis_server, tiny_model, tmp_path):
    store = tmp_path / "store"
    report = produce(produce_config(redis_server.url, tiny_model, str(store), run=RUN, token_budget=512,
                                    max_length=512, overlong="truncate"))
    assert report.batches >= 8
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url, "HSX_TEST_MIN_BATCH_SECONDS": "0.4"}
    procs = _roles(env, tmp_path / "spool", logs)
    try:
        # ---- trainer 1: starts with nothing done, reads about half the run, then "crashes"
        follower = RunFollower(redis_server.url, RUN, poll_seconds=0.05, timeout_seconds=120)
        assert follower.manifest.store.url == str(store)       # the store comes from the run's manifest
        loader = DataLoader(follower, batch_size=4, collate_fn=collate_packed)
        first, cursor, started = [], None, None
        for batch in loader:
            if started is None:   # the trainer's first step: the run is not complete yet
                started = (ledger.run_totals(r, RUN)["batches"], r.scard(RunKeys(RUN).done))
                assert torch.isfinite(batch["hidden_states"]).all()
            first += batch["sample_ids"]
            cursor = batch["cursor"]
            if len(first) >= report.samples // 2:
                break
        assert started[1] < started[0], f"first step only after the run completed: {started}"
        seen_at = dict(follower.stats.seen_at)

        # ---- trainer 2: a new process would pass the saved cursor back
        resumed = RunFollower(redis_server.url, RUN, cursor=cursor, poll_seconds=0.05, timeout_seconds=120)
        rest = [s["sample_id"] for s in resumed]          # ends by itself once the run is COMPLETE
        assert resumed.complete()
        seen_at.update(resumed.stats.seen_at)
        procs[0].wait(timeout=60)    # the burst worker exits once its queue is drained
    finally:
        _stop(procs)
    assert procs[0].returncode == 0, (logs / "worker.log").read_text()[-2000:]

    # nothing repeated, nothing skipped, and in the ledger's order
    keys = RunKeys(RUN)
    sequence = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    specs = ledger.all_specs(r, RUN)
    expected = [sid for bid in sequence for sid in specs[bid].sample_ids]
    assert first + rest == expected
    assert len(expected) == report.samples and sorted(sequence) == sorted(specs)

    # the same order again from the start (deterministic), and it matches the store's completed run
    again = [s["sample_id"] for s in RunFollower(redis_server.url, RUN, timeout_seconds=5)]
    assert again == expected
    complete = RunDataset(str(store), RUN)
    by_id = {s["sample_id"]: s for s in RunFollower(redis_server.url, RUN, cursor=Cursor(len(sequence) - 1, 0))}
    for sid, sample in by_id.items():
        assert torch.equal(sample["hidden_states"], complete.get(sid)["hidden_states"])

    # delay from "recorded done" (the uploader's done_log time) to the trainer decoding the batch
    done_at = {text(b): s for b, s in r.zrange(keys.done_log, 0, -1, withscores=True)}
    delays = [seen_at[b] - done_at[b] for b in seen_at if b in done_at and seen_at[b] >= done_at[b] - 0.05]
    waited = [d for d in delays if d >= 0]
    print(f"follow delay over {len(waited)} batches: median {statistics.median(waited) * 1000:.0f} ms, "
          f"max {max(waited) * 1000:.0f} ms (poll 50 ms)")
    assert max(waited) < 5.0


def test_cursor_is_checked_and_a_finished_run_ends(r, redis_server, tiny_model, tmp_path):
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="fdone")
    with pytest.raises(ReaderError, match="POSITION:ROW"):
        RunFollower(redis_server.url, "fdone", cursor="7")
    n = sum(1 for _ in RunFollower(redis_server.url, "fdone", timeout_seconds=5))
    assert n == 160
    # a run recorded by an hsx without done_seq: the follower gives its batches a place, in batch-id order
    keys = RunKeys("fdone")
    r.delete(keys.done_seq, keys.done_seq_pos)
    ids = [s["batch_id"] for s in RunFollower(redis_server.url, "fdone", timeout_seconds=5)]
    assert ids == sorted(ids) and len(ids) == 160
    # a cursor in the middle of a batch resumes at the next row of that batch
    sequence = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    pos = next(i for i, b in enumerate(sequence) if len(ledger.get_spec(r, "fdone", b).sample_ids) >= 3)
    tail = [s["sample_id"] for s in RunFollower(redis_server.url, "fdone", cursor=Cursor(pos, 2))]
    assert tail[0] == ledger.get_spec(r, "fdone", sequence[pos]).sample_ids[2]
    assert json.loads(r.hget(keys.done_info, sequence[0]))["sha256"]
