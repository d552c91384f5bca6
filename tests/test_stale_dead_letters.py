"""Issue 23 item 12: after a Redis loss (the ledger rebuilt from the store) a batch done is no dead letter.

Before: a run showed COMPLETE and "FAILED 1" at once. How the stale dead letter comes about for real:
Redis restarts empty, the run's manifest is back (the producer re-running) but the plan entry of a
batch is not saved yet when an upload of that batch (re-enqueued from a spool) runs: the uploader
sends it straight to dead letters as "not in the plan". The producer then rebuilds the ledger from the
store, where the batch's object is whole, and records it done.
"""

from __future__ import annotations

from hsx.life import ledger, queues
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress, summary_lines
from hsx.runspec.manifest import Manifest
from hsx.store import open_store
from producer.produce import produce
from tests.manifests import example_manifest
from tests.pipeline import produce_config, run_pipeline, upload_config

RUN = "sd"
STALE = "b0000001"


def test_a_batch_rebuilt_done_is_no_dead_letter(r, redis_server, tiny_model, tmp_path):
    from uploader.worker import run_uploader

    store_dir, spool = tmp_path / "store", tmp_path / "spool"
    run_pipeline(redis_server.url, tiny_model, str(store_dir), spool, run=RUN)
    total = len(ledger.all_specs(r, RUN))
    r.flushall()  # Redis lost everything
    manifest = Manifest.load(open_store(str(store_dir)), RUN)
    ledger.save_plan(r, RUN, manifest, [], {"batches": total, "planning": 1})  # the producer is back, mid-plan
    queues.enqueue_upload(r, "testhost", RUN, STALE, str(spool / RUN / f"{STALE}.safetensors"), 10, "0" * 64, seq=1)
    run_uploader(upload_config(redis_server.url, spool))
    assert list(ledger.dead_letters(r, RUN)) == [STALE]  # the upload that ran too early

    again = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run=RUN))
    assert again.rebuilt == total
    p = run_progress(r, RUN)
    assert p["complete"] and p["dead_letters"] == {} and p["failures"] == {}
    assert ledger.dead_letters(r, RUN) == {}  # gone from Redis, not only from the view
    lines = summary_lines(p)
    assert lines[0].endswith("COMPLETE") and not any("FAILED" in line for line in lines), lines


def test_done_clears_a_batch_failure_and_a_done_batch_records_none(r):
    spec = ledger.BatchSpec(batch_id="b1", index=1, shard="00000", samples=1, tokens=4, padded=4, padded_len=4,
                            sample_ids=["s1"])
    ledger.save_plan(r, "dl", example_manifest("dl"), [spec], {"batches": 1})
    assert ledger.record_failure(r, "dl", "b1", "boom", max_attempts=1) == 1 and ledger.dead_letters(r, "dl")
    ledger.mark_done(r, "dl", spec, "dl/batches/00000/b1.safetensors", 10, "0" * 64, by="test")
    assert ledger.dead_letters(r, "dl") == {} and ledger.failures(r, "dl") == {}
    assert ledger.record_failure(r, "dl", "b1", "late copy failed", max_attempts=1) == 0
    assert ledger.dead_letters(r, "dl") == {} and ledger.failures(r, "dl") == {}
    r.hset(RunKeys("dl").dead, "b1", '{"attempts": 3, "last_error": "old", "ts": 1}')  # an older hsx left it
    assert run_progress(r, "dl")["dead_letters"] == {}
    assert ledger.drop_failures_of_done(r, "dl") == ["b1"] and ledger.dead_letters(r, "dl") == {}
