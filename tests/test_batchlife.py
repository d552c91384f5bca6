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

from hsx.life import batchlife, donesequence, leases, ledger, queues, uploadpolicy
from hsx.life.batchlife import State
from hsx.life.keys import RunKeys
from hsx.life.ledger import BatchSpec
from hsx.life.queues import UploadJob
from hsx.life.uploadpolicy import UploadFailure
from tests.manifests import example_manifest
from tests.pipeline import produce_config, upload_config, worker_config
from tests.waiting import scaled

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
    assert batchlife.state_of(r, RUN, BID) is State.DONE and donesequence.done_sequence(r, RUN, 0) == [BID]
    assert ledger.int_hash(r, keys.counters)["batches"] == 1 and ledger.done_record(r, RUN, BID)["size"] == 4096

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


# ---- the decisions the roles used to make --------------------------------------------------------------
UPLOAD = UploadJob(HOST, f"/spool/{RUN}/{BID}.safetensors", 4096, "a" * 64, "memory")


def _upload_kwargs(r) -> list[dict]:
    q = queues.queue(r, queues.upload_queue_name(HOST))
    return [q.fetch_job(job_id).kwargs for job_id in q.get_job_ids()]


def _failed(r, why, retry=2, max_attempts=3, error="boom"):
    waited = []
    with batchlife.uploading(r, RUN, BID, UPLOAD, 60):
        failure = batchlife.upload_failed(r, RUN, BID, UPLOAD, why, error, retry, max_attempts, wait=waited.append)
    return failure, waited


@pytest.mark.parametrize("why, failure, extract_jobs, upload_retry, waits, record", [
    # the spool file is gone: counted, extracted again, no upload
    (UploadFailure.LOST, (State.FAILED, 1), 1, None, 0, "upload: boom"),
    # the store refused for good: counted, the same file again after the backoff, retry + 1
    (UploadFailure.REFUSED, (State.FAILED, 1), 0, 3, 1, "upload: store refused: boom"),
    # not in the plan: a dead letter at once
    (UploadFailure.UNPLANNED, (State.DEAD, 1), 0, None, 0, None),
    # store trouble: nothing counted, the same file again after the backoff
    (UploadFailure.TROUBLE, None, 0, 3, 1, None),
    # this uploader cannot do it: put back untouched at once (same retry count), nothing counted
    (UploadFailure.NOT_HERE, None, 0, 2, 0, None),
])
def test_each_kind_of_upload_failure_does_what_its_row_says(r, why, failure, extract_jobs, upload_retry, waits,
                                                            record):
    keys = RunKeys(RUN)
    _plan(r)
    got, waited = _failed(r, why)
    assert got == failure
    assert len(_extract_jobs(r)) == extract_jobs
    assert [kw["retry"] for kw in _upload_kwargs(r)] == ([] if upload_retry is None else [upload_retry])
    if upload_retry is not None:  # the typed job, encoded as before: same file, tier and host
        assert {k: v for k, v in _upload_kwargs(r)[0].items() if k != "retry"} == {
            "run": RUN, "batch_id": BID, "path": UPLOAD.path, "size": 4096, "sha256": "a" * 64, "tier": "memory"}
    assert len(waited) == waits and all(0 <= w <= uploadpolicy.UPLOAD_RETRY_BASE_SECONDS * 4 for w in waited)
    assert (json.loads(r.hget(keys.failures, BID))["last_error"] if r.hexists(keys.failures, BID) else None) == record
    assert r.zscore(keys.upload_leases, BID) is None and not r.hexists(keys.kept_uploads, BID)


def test_a_refused_upload_at_the_limit_is_a_dead_letter_that_keeps_its_file(r):
    keys = RunKeys(RUN)
    _plan(r)
    assert _failed(r, UploadFailure.REFUSED, max_attempts=2)[0] == (State.FAILED, 1)
    r.delete(queues.queue(r, queues.upload_queue_name(HOST)).key)
    failure, waited = _failed(r, UploadFailure.REFUSED, max_attempts=2)
    assert failure == (State.DEAD, 2) and waited == [] and _upload_kwargs(r) == [] and _extract_jobs(r) == []
    assert json.loads(r.hget(keys.kept_uploads, BID)) == UPLOAD._asdict()   # written in the failure's script
    assert batchlife.retry(r, RUN, [BID]) == [BID]                         # the kept file is uploaded again
    assert [kw["path"] for kw in _upload_kwargs(r)] == [UPLOAD.path] and _extract_jobs(r) == []
    # a batch done meanwhile (a duplicate copy uploaded): the late refusal counts nothing, no upload again
    r.delete(queues.queue(r, queues.upload_queue_name(HOST)).key)
    batchlife.finish(r, RUN, _plan(r)[BID], "k", 4096, "a" * 64, by="t")
    assert _failed(r, UploadFailure.REFUSED)[0] == (State.DONE, 0) and _upload_kwargs(r) == []


def test_an_upload_job_an_older_hsx_recorded_still_decodes():
    assert UploadJob.from_json('{"host": "h", "path": "/p", "size": 3, "sha256": "00"}') == UploadJob("h", "/p", 3, "00")
    assert UploadJob("h", "/p", 3, "00").to_json() == json.dumps(
        {"host": "h", "path": "/p", "size": 3, "sha256": "00", "tier": "disk"})


def test_release_if_done_lets_go_only_of_a_done_batch(r):
    keys = RunKeys(RUN)
    specs = _plan(r)
    batchlife.lease(r, RUN, BID, 60)
    assert not batchlife.release_if_done(r, RUN, BID) and r.zscore(keys.extract_leases, BID) is not None
    batchlife.finish(r, RUN, specs[BID], "k", 1, "0" * 64, by="elsewhere")
    assert batchlife.release_if_done(r, RUN, BID) and r.zscore(keys.extract_leases, BID) is None


def test_withdraw_takes_queued_jobs_out_of_the_plan_and_leaves_the_rest(r, monkeypatch):
    keys = RunKeys(RUN)
    specs = _plan(r)
    extra = [BatchSpec(f"b000000{i}", i, "00000", 2, 10, 12, 6, [f"s{i}a", f"s{i}b"]) for i in range(2, 6)]
    ledger.save_plan(r, RUN, example_manifest(RUN), [*specs.values(), *extra], {"batches": 6})
    r.hset(keys.windows, "0", "{}")
    batchlife.enqueue(r, RUN, [BID, OTHER, "b0000002", "b0000003", "b0000004"], first=True)
    q = queues.queue(r, queues.extract_queue_name(RUN))
    q.enqueue_call(queues.EXTRACT_FUNC, kwargs={}, job_id="x-otherrun-b0000009-1")   # not this run's: left alone
    batchlife.finish(r, RUN, specs[OTHER], "k", 1, "0" * 64, by="t")                # done: keeps its plan entry
    r.lrem(q.key, 1, f"x-{RUN}-b0000002-1")                                          # a worker took it: stays
    monkeypatch.setattr(batchlife, "WITHDRAW_CHUNK", 2)                             # two scripts, as a long queue has
    assert batchlife.withdraw(r, RUN) == 4
    assert q.get_job_ids() == ["x-otherrun-b0000009-1"]
    assert not r.exists(*(f"rq:job:x-{RUN}-{b}-1" for b in (BID, OTHER, "b0000003", "b0000004")))
    assert r.exists(f"rq:job:x-{RUN}-b0000002-1")
    assert sorted(ledger.all_specs(r, RUN)) == [OTHER, "b0000002", "b0000005"]
    assert not r.exists(keys.windows) and ledger.int_hash(r, keys.totals) == {"batches": 3, "planning": 1}
    assert batchlife.withdraw(r, RUN) == 0 and ledger.int_hash(r, keys.totals)["batches"] == 3


# ---- one owner, read from the syntax trees ----------------------------------------------------------
# The primitives that write a batch's state, by the module defining each: called (or named) only there and in
# hsx/life/batchlife.py, and never on hsx.life's face. ``job_seq`` (the job-id counter) is a key of RunKeys.
PRIMITIVES = {"hsx.life.ledger": ("mark_done", "unmark_done", "record_failure", "mark_spooled", "clear_failure",
                                  "take_dead_letters"),
              "hsx.life.queues": ("enqueue_extract", "enqueue_upload", "enqueue_upload_job"),
              "hsx.life.leases": ("take", "drop")}
FORBIDDEN = {f"{module}.{name}": module for module, names in PRIMITIVES.items() for name in names}
OWNER = "hsx.life.batchlife"
PRODUCT = ("hsx", "gpu_worker", "uploader", "producer", "dashboard", "hsx_cli", "hsx_tools", "hsx_reader")


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def primitive_uses(module: str, source: str) -> list[str]:
    """Each place ``module``'s source names a primitive of another module (through any import or alias:
    ``ledger.mark_done``, ``life.ledger.mark_done``, ``from hsx.life.leases import drop as d``), or ``job_seq``."""
    if module == OWNER:
        return []
    tree = ast.parse(source)
    package = module if module.endswith("__init__") else module.rpartition(".")[0]
    bound: dict[str, str] = {}   # local name -> the dotted name it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else alias.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                if FORBIDDEN.get(f"{base}.{alias.name}", module) != module:
                    found.append(f"{module}:{node.lineno}: imports {base}.{alias.name}")

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            head = dotted(expr.value)
            return f"{head}.{expr.attr}" if head else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "job_seq" and module != "hsx.life.keys":
            found.append(f"{module}:{node.lineno}: .job_seq")
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            name = dotted(node)
            if name in FORBIDDEN and FORBIDDEN[name] != module:
                found.append(f"{module}:{node.lineno}: {name}")
    return found


def test_only_batchlife_writes_a_transition():
    """Every write of a batch's queue jobs, leases, failure and dead-letter records goes through batchlife: read
    from every product module's syntax tree; and none of those primitives is offered on hsx.life's face."""
    import hsx.life as face
    from hsx.life import leases as lease_module

    modules = {_module_of(path): path for folder in PRODUCT for path in sorted((ROOT / folder).rglob("*.py"))}
    assert "hsx.life.batchlife" in modules and "uploader.jobs" in modules and len(modules) > 100
    found = [use for module, path in modules.items() for use in primitive_uses(module, path.read_text())]
    assert found == [], "a transition written outside hsx/life/batchlife.py:\n" + "\n".join(found)
    primitives = [getattr({"hsx.life.ledger": ledger, "hsx.life.queues": queues, "hsx.life.leases": lease_module}[m], n)
                  for m, names in PRIMITIVES.items() for n in names]
    offered = [name for name in face.__all__ if any(getattr(face, name) is p for p in primitives)
               or name in ("ledger", "queues", "leases", "job_seq")]
    assert offered == [], f"batch-state primitives on hsx.life's face: {offered}"


@pytest.mark.parametrize("planted", [
    "from hsx.life import ledger\ndef f(r):\n    ledger.mark_done(r, 'run', None, 'k', 1, '0', by='me')\n",
    "from hsx import life\nlife.ledger.record_failure(r, 'run', 'b', 'boom', 3)\n",
    "import hsx.life.queues\nhsx.life.queues.enqueue_extract(r, 'run', 'b', 7)\n",
    "from hsx.life.leases import drop as let_go\nlet_go(r, 'zset', 'b')\n",
    "from hsx.life import leases as L\ncallbacks = [L.take]\n",
    "from hsx.life import RunKeys\nr.incrby(RunKeys('run').job_seq, 1)\n",
])
def test_the_one_owner_rule_finds_a_planted_write(planted):
    assert primitive_uses("producer.planted", planted), planted
    assert primitive_uses("hsx.life.batchlife", planted) == []   # the owner may


def test_the_one_owner_rule_leaves_other_takes_and_drops_alone():
    source = ("from hsx.life import ledger, leases\nprefetcher.take(spec)\npool.drop(x)\nledger.is_done(r, 'run', 'b')\n"
              "leases.refresh(r, 'zset', ['b'], 60)\ndef mark_done():\n    pass\n")
    assert primitive_uses("gpu_worker.planted", source) == []
    assert primitive_uses("hsx.life.ledger", "def f(r):\n    mark_done(r)\n    take_dead_letters(r, 'run')\n") == []


def test_a_primitive_put_on_the_face_is_found(monkeypatch):
    import hsx.life as face

    monkeypatch.setattr(face, "settle", ledger.mark_done, raising=False)
    monkeypatch.setattr(face, "__all__", [*face.__all__, "settle"])
    with pytest.raises(AssertionError, match="on hsx.life's face: \\['settle'\\]"):
        test_only_batchlife_writes_a_transition()


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
                             job_id=queues.extract_job_id(run, bid, 1), timeout=scaled(600))
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run=run))
    assert {extract.fetch_job(queues.extract_job_id(run, bid, 1)).get_status() for bid in bids} == {"finished"}

    upload = Queue(queues.upload_queue_name("testhost"), connection=r, serializer=JSONSerializer)
    new_jobs = [upload.fetch_job(job_id) for job_id in upload.get_job_ids()]
    assert len(new_jobs) == len(bids) and all("attempt" not in job.kwargs for job in new_jobs)
    upload.empty()
    for n, job in enumerate(new_jobs):  # the same uploads, as an older hsx queued them
        upload.enqueue_call(queues.UPLOAD_FUNC, kwargs={**job.kwargs, "attempt": 1001 + n},
                            job_id=queues.upload_job_id(run, job.kwargs["batch_id"], 1001 + n), timeout=scaled(600))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    assert ledger.done_ids(r, run) == set(bids) and ledger.dead_letters(r, run) == {} and ledger.failures(r, run) == {}
