"""Issue 21 item 3: one owner of a batch's life (hsx/life/batchlife.py).

A batch walked through every transition on the conftest's private redis-server, with its keys checked
after each; illegal transitions refused with nothing written; jobs an older hsx queued (with the
``attempt`` field) still run; and, read from the syntax trees, no other module writes a transition.
Issue 33 item 3: the uploader's failure table, the writer's "already done?" and ``withdraw`` are
batchlife's; the upload job is one typed record (``UploadJob``), its Redis encoding as before.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from hsx.life import batchlife, leases, ledger, queues
from hsx.life.batchlife import State
from hsx.life.keys import RunKeys
from hsx.life.ledger import BatchSpec
from hsx.life.queues import UploadJob
from tests.manifests import example_manifest
from tests.pipeline import produce_config, upload_config, worker_config

RUN = "life"
BID, OTHER = "b0000000", "b0000001"
HOST = "h1"
ROOT = Path(__file__).resolve().parent.parent


def _plan(r) -> dict[str, BatchSpec]:
    specs = [BatchSpec(b, i, "00000", samples=2, tokens=10, padded=12, padded_len=6, sample_ids=[f"s{i}a", f"s{i}b"])
             for i, b in enumerate((BID, OTHER))]
    ledger.save_plan(r, RUN, example_manifest(RUN), specs, {"batches": len(specs)})
    return {s.batch_id: s for s in specs}


def _extract_jobs(r) -> list[str]:
    return queues.queue(r, queues.extract_queue_name(RUN)).get_job_ids()


def _upload_jobs(r) -> list[str]:
    return queues.queue(r, queues.upload_queue_name(HOST)).get_job_ids()


def test_a_batch_walks_every_transition_and_each_writes_its_keys(r):
    keys = RunKeys(RUN)
    spec = _plan(r)[BID]
    assert batchlife.state_of(r, RUN, BID) is State.PLANNED and batchlife.state_of(r, RUN, "nope") is None

    # -> planned: the producer's first job (suffix 1), no attempt field in it
    batchlife.enqueue(r, RUN, [BID], first=True)
    assert _extract_jobs(r) == [f"x-{RUN}-{BID}-1"]
    assert queues.queue(r, queues.extract_queue_name(RUN)).fetch_job(f"x-{RUN}-{BID}-1").kwargs == {
        "run": RUN, "batch_id": BID}
    r.delete(queues.queue(r, queues.extract_queue_name(RUN)).key)  # a worker popped it

    # planned -> leased: the spec back, a lease on Redis' clock
    assert batchlife.lease(r, RUN, BID, 60) == spec
    assert r.zscore(keys.extract_leases, BID) > leases.redis_now(r) + 50
    assert batchlife.state_of(r, RUN, BID) is State.LEASED

    # leased -> spooled: upload job (fresh suffix), spool log and bytes, extract lease gone
    pipe = r.pipeline()
    batchlife.spool(r, RUN, BID, HOST, "/spool/life/b0000000.safetensors", 4096, "a" * 64, "disk", pipe)
    assert r.zscore(keys.extract_leases, BID) is not None  # nothing written before the caller executes
    pipe.execute()
    assert r.zscore(keys.extract_leases, BID) is None and r.zscore(keys.spooled_log, BID) is not None
    assert r.hget(keys.counters, ledger.WRITTEN_BYTES) == b"4096"
    [upload_id] = _upload_jobs(r)
    assert upload_id == f"u-{RUN}-{BID}-1001"
    assert "attempt" not in queues.queue(r, queues.upload_queue_name(HOST)).fetch_job(upload_id).kwargs
    assert batchlife.state_of(r, RUN, BID) is State.SPOOLED

    # spooled -> uploading -> done; the lease goes on the way out
    r.delete(queues.queue(r, queues.upload_queue_name(HOST)).key)
    job = UploadJob(HOST, "/spool/life/b0000000.safetensors", 4096, "a" * 64, "disk")
    with batchlife.uploading(r, RUN, BID, job, 60):
        assert batchlife.state_of(r, RUN, BID) is State.UPLOADING
        assert json.loads(r.hget(keys.upload_jobs, BID)) == {  # the record an older hsx wrote and reads
            "host": HOST, "path": "/spool/life/b0000000.safetensors", "size": 4096, "sha256": "a" * 64, "tier": "disk"}
        assert r.zscore(keys.upload_leases, BID) is not None
        assert batchlife.finish(r, RUN, spec, "life/batches/00000/b0000000.safetensors", 4096, "a" * 64, by="t")
    assert r.zscore(keys.upload_leases, BID) is None and not r.hexists(keys.upload_jobs, BID)
    assert batchlife.state_of(r, RUN, BID) is State.DONE and ledger.done_sequence(r, RUN, 0) == [BID]
    assert ledger.int_hash(r, keys.counters)["batches"] == 1 and json.loads(r.hget(keys.done_info, BID))["size"] == 4096

    # done -> planned (verify --repair): out of the ledger, counters back, queued at the front
    batchlife.enqueue(r, RUN, [OTHER], first=True)
    assert batchlife.reopen(r, RUN, spec)
    assert not ledger.is_done(r, RUN, BID) and ledger.int_hash(r, keys.counters)["batches"] == 0
    assert _extract_jobs(r) == [f"x-{RUN}-{BID}-1002", f"x-{RUN}-{OTHER}-1"]
    assert batchlife.state_of(r, RUN, BID) is State.PLANNED
    r.delete(queues.queue(r, queues.extract_queue_name(RUN)).key)

    # leased -> failed (counted, queued again, lease gone) -> leased -> dead (no job)
    batchlife.lease(r, RUN, BID, 60)
    batchlife.release(r, RUN, BID)
    assert batchlife.fail(r, RUN, BID, "boom 1", max_attempts=2) == (State.FAILED, 1)
    assert r.zscore(keys.extract_leases, BID) is None and _extract_jobs(r) == [f"x-{RUN}-{BID}-1003"]
    assert json.loads(r.hget(keys.failures, BID))["attempts"] == 1
    assert batchlife.state_of(r, RUN, BID) is State.FAILED
    r.delete(queues.queue(r, queues.extract_queue_name(RUN)).key)
    batchlife.lease(r, RUN, BID, 60)
    batchlife.release(r, RUN, BID)
    assert batchlife.fail(r, RUN, BID, "boom 2", max_attempts=2) == (State.DEAD, 2)
    assert not r.hexists(keys.failures, BID) and json.loads(r.hget(keys.dead, BID))["last_error"] == "boom 2"
    assert _extract_jobs(r) == [] and batchlife.state_of(r, RUN, BID) is State.DEAD

    # dead -> planned (retry-failed): record gone, fresh job
    assert batchlife.retry(r, RUN, [BID]) == [BID]
    assert not r.hexists(keys.dead, BID) and _extract_jobs(r) == [f"x-{RUN}-{BID}-1004"]
    r.delete(queues.queue(r, queues.extract_queue_name(RUN)).key)

    # leased -> planned, uncounted (a stopping worker), once: a second hand-back finds no lease
    batchlife.lease(r, RUN, BID, 60)
    assert batchlife.hand_back(r, RUN, BID) and not batchlife.hand_back(r, RUN, BID)
    assert _extract_jobs(r) == [f"x-{RUN}-{BID}-1005"] and not r.hexists(keys.failures, BID)
    r.delete(queues.queue(r, queues.extract_queue_name(RUN)).key)

    # expired extract lease -> failed (reap, at the front); expired upload lease -> spooled
    batchlife.lease(r, RUN, BID, 0)
    assert batchlife.reap(r, RUN, max_attempts=3) == {"extract": [BID], "upload": []}
    assert json.loads(r.hget(keys.failures, BID))["last_error"].startswith("worker lost")
    assert _extract_jobs(r) == [f"x-{RUN}-{BID}-1006"]
    with batchlife.uploading(r, RUN, OTHER, job._replace(path="/spool/life/b0000001.safetensors"), 0):
        assert batchlife.reap(r, RUN, max_attempts=3) == {"extract": [], "upload": [OTHER]}
        assert batchlife.state_of(r, RUN, OTHER) is State.SPOOLED
    [again] = _upload_jobs(r)
    assert again == f"u-{RUN}-{OTHER}-1007"
    assert queues.queue(r, queues.upload_queue_name(HOST)).fetch_job(again).kwargs["path"].endswith("b0000001.safetensors")

    # uploading -> spooled (store trouble): a new upload job, the retry counted in it
    with batchlife.uploading(r, RUN, OTHER, job, 60):
        batchlife.requeue_upload(r, HOST, RUN, OTHER, job.path, 4096, "a" * 64, "disk", retry=2)
    last = queues.queue(r, queues.upload_queue_name(HOST)).fetch_job(_upload_jobs(r)[-1])
    assert last.id == f"u-{RUN}-{OTHER}-1008" and last.kwargs["retry"] == 2
    assert batchlife.state_of(r, RUN, OTHER) is State.SPOOLED
    assert list(batchlife.next_seqs(r, RUN, 3)) == [1009, 1010, 1011]  # one counter, never reused


def test_illegal_transitions_are_refused_and_write_nothing(r):
    keys = RunKeys(RUN)
    spec = _plan(r)[BID]
    batchlife.finish(r, RUN, spec, "k", 1, "0" * 64, by="t")
    before = {k: r.dump(k) for k in sorted(r.keys("*"))}

    with pytest.raises(batchlife.IllegalTransition, match="is done; it cannot become leased") as refused:
        batchlife.lease(r, RUN, BID, 60)                                    # done -> leased
    assert refused.value.state is State.DONE and refused.value.to is State.LEASED
    assert batchlife.fail(r, RUN, BID, "late copy", max_attempts=1) == (State.DONE, 0)  # done -> failed
    with pytest.raises(batchlife.NotRetryable, match="b0000000 \\(done\\)"):
        batchlife.retry(r, RUN, [BID])                                      # done -> planned by retry
    with pytest.raises(batchlife.NotRetryable, match="not failed for good"):
        batchlife.retry(r, RUN, [OTHER])                                    # planned -> planned by retry
    assert not batchlife.reopen(r, RUN, _plan(r)[OTHER])                    # planned -> planned by reopen
    assert batchlife.lease(r, RUN, "b9999999", 60) is None                  # not in the plan: no lease
    assert {k: r.dump(k) for k in sorted(r.keys("*"))} == before
    assert r.zcard(keys.extract_leases) == 0 and not r.exists(keys.failures, keys.dead)


# ---- one owner, read from the source -----------------------------------------------------------------
PRIMITIVES = re.compile(r"\b(ledger\.(mark_done|unmark_done|record_failure|mark_spooled|clear_failure|take_dead_letters)"
                        r"|queues\.enqueue_(extract|upload)|leases\.(take|drop)|job_seq)\b")
PRODUCT = ("hsx", "gpu_worker", "uploader", "producer", "dashboard", "hsx_cli", "hsx_tools", "hsx_reader")


def test_only_batchlife_writes_a_transition():
    """Every write of a batch's queue jobs, leases, failure and dead-letter records goes through batchlife."""
    owner = ROOT / "hsx" / "life" / "batchlife.py"
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py")) if path != owner
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if PRIMITIVES.search(line) and not line.lstrip().startswith(("#", "def "))
             and "``" not in line]
    found = [f for f in found if not f.startswith("hsx/life/keys.py")]  # the key template itself
    assert found == [], "a transition written outside hsx/life/batchlife.py:\n" + "\n".join(found)


def test_one_exception_for_a_vanished_run():
    classes = [f"{path.relative_to(ROOT)}: {m.group(0)}" for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py"))
               for m in re.finditer(r"class (RunVanished|RunNotPlanned)\b", path.read_text())]
    assert classes == ["hsx/life/ledger.py: class RunVanished"]
    from gpu_worker import worker
    from uploader import jobs, runtime

    assert worker.RunVanished is jobs.RunVanished is runtime.RunVanished is ledger.RunVanished


# ---- jobs an older hsx queued ----------------------------------------------------------------------------
def test_jobs_queued_with_the_old_attempt_field_still_run(r, redis_server, tiny_model, tmp_path):
    """Before issue 21, every extract and upload job carried ``attempt`` (a copy of its id's suffix)."""
    from gpu_worker.worker import run_worker
    from producer.produce import produce
    from uploader.worker import run_uploader

    run = "oldjobs"
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=run, enqueue=False))
    bids = sorted(ledger.all_specs(r, run))
    extract = Queue(queues.extract_queue_name(run), connection=r, serializer=JSONSerializer)
    for bid in bids:  # as hsx 0.x wrote them
        extract.enqueue_call(queues.EXTRACT_FUNC, kwargs={"run": run, "batch_id": bid, "attempt": 1},
                             job_id=queues.extract_job_id(run, bid, 1), timeout=600)
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run=run))
    assert {extract.fetch_job(queues.extract_job_id(run, bid, 1)).get_status() for bid in bids} == {"finished"}

    upload = Queue(queues.upload_queue_name("testhost"), connection=r, serializer=JSONSerializer)
    new_jobs = [upload.fetch_job(job_id) for job_id in upload.get_job_ids()]
    assert len(new_jobs) == len(bids) and all("attempt" not in job.kwargs for job in new_jobs)
    upload.empty()
    for n, job in enumerate(new_jobs):  # the same uploads, as an older hsx queued them
        upload.enqueue_call(queues.UPLOAD_FUNC, kwargs={**job.kwargs, "attempt": 1001 + n},
                            job_id=queues.upload_job_id(run, job.kwargs["batch_id"], 1001 + n), timeout=600)
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    assert ledger.done_ids(r, run) == set(bids) and ledger.dead_letters(r, run) == {} and ledger.failures(r, run) == {}
