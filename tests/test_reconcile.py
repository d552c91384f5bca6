"""The queue is a cache of the ledger: whatever empties it, the reconciler puts every planned batch back."""

from hsx.life import batchlife, leases, ledger, queues, reconcile
from hsx.life.keys import RunKeys
from hsx.monitor.progress import run_progress, summary_lines
from hsx.store import open_store
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import produce_config, upload_config, worker_config
from tests.waiting import scaled


def _finish(redis_url, spool, run):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    run_worker(worker_config(redis_url, spool, run=run))
    run_uploader(upload_config(redis_url, spool))


def test_reconciler_puts_back_batches_no_queue_holds(r, redis_server, tiny_model, tmp_path):
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="rc"))
    total = ledger.run_totals(r, "rc")["batches"]
    q = queues.queue(r, queues.extract_queue_name("rc"))
    ids = q.get_job_ids()
    # (a) a worker died between rq's dequeue and taking the lease: the job left the queue, no lease was taken
    r.lrem(q.key, 1, ids[0])
    # (b) someone deleted a job and emptied... a part of the queue at /rq (rq's own calls)
    q.fetch_job(ids[1]).delete()
    for job_id in ids[2:5]:
        r.lrem(q.key, 1, job_id)
    lost = {queues.batch_of_job(j)[1] for j in ids[:5]}
    # a leased batch, a dead one and a queued one are accounted for: never re-enqueued
    assert reconcile.orphans(r, "rc") == lost
    assert reconcile.reconcile(r, "rc", grace=0) == []        # first sighting: remembered, not acted on
    assert reconcile.reconcile(r, "rc", grace=3600) == []     # not yet orphaned for the grace period
    assert reconcile.reconcile(r, "rc", grace=0) == sorted(lost)
    assert queues.pending_extract(r, "rc") == set(ledger.all_specs(r, "rc"))
    assert reconcile.reconcile(r, "rc", grace=0) == []        # nothing left to do, nothing done twice
    _finish(redis_server.url, tmp_path / "spool", "rc")
    assert run_progress(r, "rc")["done"]["batches"] == total
    assert verify_run(r, open_store(str(store_dir)), "rc").ok


def test_producer_killed_before_enqueueing_is_reconciled(r, redis_server, tiny_model, tmp_path):
    # (c) the plan was saved, nothing enqueued (the producer died): status says so, the reconciler enqueues all
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="pk", enqueue=False))
    r.delete(RunKeys("pk").planned_only)  # what a producer killed between a window's plan and its enqueue leaves
    r.delete(RunKeys("pk").fed)  # ... as an hsx before issue 42 left it: every batch should have had a job
    total = ledger.run_totals(r, "pk")["batches"]
    p = run_progress(r, "pk")
    assert p["stalled"].startswith(f"{total} of {total} batches left are in no queue") and p["eta_seconds"] is None
    assert any(line.strip().startswith("STALLED") for line in summary_lines(p))
    r.set("hsx:pk:producer_lock", "someone")  # a producer still enqueueing: the reconciler keeps out
    assert reconcile.reconcile(r, "pk", grace=0) == [] and not r.exists(RunKeys("pk").orphans)
    r.delete("hsx:pk:producer_lock")
    # through the heartbeat entry point: one pass per interval across processes
    assert reconcile.maybe_reconcile(r, "pk", interval=3600, grace=0) == []
    assert reconcile.maybe_reconcile(r, "pk", interval=3600, grace=0) is None  # the lock holds the next one off
    r.delete(RunKeys("pk").reconcile_lock)
    assert len(reconcile.maybe_reconcile(r, "pk", interval=3600, grace=0)) == total
    assert run_progress(r, "pk")["stalled"] == f"{total} batches queued and no live worker of this run"
    _finish(redis_server.url, tmp_path / "spool", "pk")
    assert run_progress(r, "pk")["complete"]


def test_a_plan_not_fed_yet_is_fed_not_reconciled(r, redis_server, tiny_model, tmp_path):
    # A run is fed to its queue QUEUE_AHEAD jobs ahead (issue 42): batches past ``fed`` are no orphans, a pass feeds
    # them (and status says they wait to be fed, not that they are lost).
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="pf", enqueue=False))
    r.delete(RunKeys("pf").planned_only)  # a producer killed between a window's plan and its enqueue
    total = ledger.run_totals(r, "pf")["batches"]
    assert batchlife.fed_count(r, "pf") == 0 and reconcile.orphans(r, "pf") == set()
    assert run_progress(r, "pf")["stalled"].startswith(f"{total} of {total} batches left are not fed to the queue yet")
    assert reconcile.reconcile(r, "pf", grace=0) == []  # no orphan: fed instead
    assert queues.pending_extract(r, "pf") == set(ledger.all_specs(r, "pf")) and batchlife.fed_count(r, "pf") == total
    assert reconcile.reconcile(r, "pf", grace=0) == [] and len(queues.queue(r, queues.extract_queue_name("pf"))) == total
    _finish(redis_server.url, tmp_path / "spool", "pf")
    assert run_progress(r, "pf")["complete"]


def test_leased_dead_and_done_batches_are_left_alone(r, redis_server, tiny_model, tmp_path):
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="la", enqueue=False))
    keys = RunKeys("la")
    r.set(keys.fed, ledger.run_totals(r, "la")["batches"])  # every batch fed: each should have a job
    specs = ledger.all_specs(r, "la")
    leases.take(r, keys.extract_leases, "b0000000", lease_seconds=60)
    leases.take(r, keys.upload_leases, "b0000001", lease_seconds=60)
    ledger.record_failure(r, "la", "b0000002", "boom", max_attempts=1)
    ledger.mark_done(r, "la", specs["b0000003"], "k", 1, "0" * 64, by="test")
    queues.enqueue_upload(r, "h9", "la", "b0000004", "/spool/x", 1, "0" * 64, seq=1)
    r.hset(keys.hosts, "h9", "{}")
    assert reconcile.orphans(r, "la") == set(specs) - {f"b000000{i}" for i in range(5)}


def test_a_job_rq_handed_out_but_not_yet_leased_is_not_lost(r, redis_server, tiny_model, tmp_path):
    """Issue 23 item 7: between rq's hand-over and the job's lease (a fresh uploader importing torch: 3.4 s at
    a 5 s lease) the batch is in no queue and no lease; it gets more graces, and is still caught if it dies."""
    import time

    from rq.serializers import JSONSerializer
    from rq.worker import SimpleWorker

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="ho"))
    q = queues.queue(r, queues.extract_queue_name("ho"))
    worker = SimpleWorker([q], connection=r, name="slow-starter", serializer=JSONSerializer, job_class=queues.HsxJob)
    worker.register_birth()
    try:
        job, _ = worker.dequeue_job_and_maintain_ttl(timeout=scaled(1))
        worker.prepare_execution(job)
        worker.prepare_job_execution(job)   # rq's bookkeeping done; the job function has not taken its lease yet
        bid = queues.batch_of_job(job.id)[1]
        assert bid in reconcile.orphans(r, "ho")
        grace = 0.4
        assert reconcile.reconcile(r, "ho", grace=grace) == []     # remembered
        time.sleep(grace * 1.5)
        assert reconcile.reconcile(r, "ho", grace=grace) == []     # past one grace: handed out, not lost yet
        time.sleep(grace * reconcile.HANDED_OUT_GRACES)
        assert reconcile.reconcile(r, "ho", grace=grace) == [bid]  # never leased: the worker died there
    finally:
        worker.register_death()


def test_each_spooling_of_a_batch_gets_its_own_upload_job(r, redis_server, tiny_model, tmp_path):
    """Issue 23 item 7: a batch extracted twice enqueued its upload twice under one job id, overwriting a job
    that may be running; each spooling now has its own id and the first job's hash is left as it was."""
    from gpu_worker.worker import run_worker

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="dup", enqueue=False))
    queues.enqueue_extract(r, "dup", "b0000000", seq=1)
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="dup"))
    up = queues.queue(r, queues.upload_queue_name("testhost"))
    (first,) = up.get_job_ids()
    r.hset(f"rq:job:{first}", "status", "started")   # an uploader holds it
    queues.enqueue_extract(r, "dup", "b0000000", seq=2)  # the reconciler's (or a duplicate's) second extraction
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="dup"))
    ids = up.get_job_ids()
    assert len(ids) == 2 and len(set(ids)) == 2 and first in ids
    assert r.hget(f"rq:job:{first}", "status") == b"started"
