"""Issue 13, item 6 (a, b): fields of a job read from Redis are untrusted (threat: write access to Redis).

A real run (tiny model, private redis-server, local store) with jobs forged through plain rq beside
hsx's own: callbacks, dependencies, webhooks and rq retries on an extract job are not honoured (the
batch is still extracted once); upload jobs whose path lies outside the spool, through a symlink out
of it, or on another batch's file, neither read nor delete that file.
"""

from __future__ import annotations

import http.server
import json
import threading

from rq import Queue, Retry
from rq.callbacks import Callback
from rq.serializers import JSONSerializer
from rq.webhook import Webhook

from hsx.life import ledger, queues
from hsx.store import layout
from tests.pipeline import produce_config, upload_config, worker_config

RUN = "trust"
PWNED = "test:pwned"  # Redis key the forged callbacks would set


def pwned(job, connection, *args):
    """What a forged callback runs, if anything imports and calls it."""
    connection.rpush(PWNED, job.id)


class _Hits(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.hits.append(self.path)
        self.send_response(204)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def _webhook_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hits)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_forged_extract_job_runs_no_callback_dependency_webhook_or_retry(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from producer.produce import produce
    from uploader.worker import run_uploader

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=RUN))
    first = queues.queue(r, queues.extract_queue_name(RUN)).get_job_ids()[0]
    bid = queues.batch_of_job(first)[1]
    hooks = _webhook_server()
    try:
        # Through plain rq, as anyone with write access to Redis could: an allowed function, JSON kwargs,
        # and every rq feature that would run something else.
        plain = Queue(queues.extract_queue_name(RUN), connection=r, serializer=JSONSerializer)
        url = f"http://127.0.0.1:{hooks.server_address[1]}/hook"
        forged = plain.enqueue_call(
            queues.EXTRACT_FUNC, kwargs={"run": RUN, "batch_id": bid, "attempt": 77}, job_id="forged-ok",
            on_success=Callback(f"{__name__}.pwned"), on_failure=Callback(f"{__name__}.pwned"),
            on_stopped=Callback("builtins.print"), retry=Retry(max=5),
            webhooks=[Webhook(url, "finished"), Webhook(url, "failed", method="POST")], at_front=True)
        plain.enqueue_call(
            queues.EXTRACT_FUNC, kwargs={"run": RUN, "batch_id": "no-such-batch", "attempt": 1}, job_id="forged-bad",
            on_failure=Callback(f"{__name__}.pwned"), retry=Retry(max=3), webhooks=[Webhook(url, "failed")],
            at_front=True)
        r.hset(forged.key, "dependency_ids", json.dumps(["rq:job:forged-bad"]))
        assert r.hget(forged.key, "success_callback_name") == f"{__name__}.pwned".encode()

        rt = run_worker(worker_config(redis_server.url, tmp_path / "spool", run=RUN))
        run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    finally:
        hooks.shutdown()
    assert r.lrange(PWNED, 0, -1) == [], "a callback named in Redis was imported and called"
    assert _Hits.hits == [], "a webhook named in Redis was sent"
    assert plain.fetch_job("forged-ok").get_status() == "finished"
    assert plain.fetch_job("forged-bad").get_status() == "failed"  # once: rq's Retry(max=3) not honoured
    assert plain.count == 0 and rt.batches_run >= 1
    assert ledger.is_done(r, RUN, bid) and ledger.dead_letters(r, RUN) == {}


def test_upload_jobs_never_touch_files_outside_their_own_spool_file(r, redis_server, tiny_model, tmp_path):
    from gpu_worker.worker import run_worker
    from producer.produce import produce
    from uploader.worker import run_uploader

    spool = tmp_path / "spool"
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=RUN))
    run_worker(worker_config(redis_server.url, spool, run=RUN))
    run_uploader(upload_config(redis_server.url, spool))
    first = sorted(ledger.all_specs(r, RUN))[0]
    assert ledger.done_ids(r, RUN) == set(ledger.all_specs(r, RUN))

    outside = tmp_path / "precious.txt"
    outside.write_text("not hsx's to delete")
    linked = tmp_path / "linked-target.txt"
    linked.write_text("reached through a symlink")
    other_run = layout.spool_path(spool, "otherrun", first)   # another run's batch, waiting for its upload
    other_run.parent.mkdir(parents=True, exist_ok=True)
    other_run.write_bytes(b"x" * 64)
    link = layout.spool_path(spool, RUN, first)                # the batch's own name, but a symlink out
    link.symlink_to(linked)
    forged_paths = {"outside": str(outside), "dotdot": str(spool / RUN / ".." / ".." / "precious.txt"),
                    "other": str(other_run), "symlink": str(link)}
    host = upload_config(redis_server.url, spool).host
    for n, path in enumerate(forged_paths.values()):
        queues.enqueue_upload(r, host, RUN, first, path, 64, "0" * 64, seq=900 + n)
    run_uploader(upload_config(redis_server.url, spool))
    assert outside.read_text() == "not hsx's to delete"
    assert linked.read_text() == "reached through a symlink"
    assert other_run.read_bytes() == b"x" * 64
    assert link.is_symlink()
    assert queues.queue(r, queues.upload_queue_name(host)).count == 0  # refused once each, not retried
    assert ledger.dead_letters(r, RUN) == {}


def test_names_from_redis_never_leave_their_directory(tmp_path):
    from hsx.store import layout

    assert layout.batch_key("run1", "00000", "b0000001") == "run1/batches/00000/b0000001.safetensors"
    for run, shard, bid in (("run1", "../../other/batches/00000", "b0000001"), ("run1", "00000", "../b0000001"),
                            ("..", "00000", "b0000001"), ("run1", "", "b0000001"), ("run1", "00000", "b/1"),
                            ("run1", "00000", ".hidden")):
        for build in (layout.batch_key, layout.input_key):
            try:
                build(run, shard, bid)
            except ValueError as exc:
                assert "not a plain name" in str(exc)
            else:
                raise AssertionError(f"{build.__name__}({run!r}, {shard!r}, {bid!r}) was accepted")
    for run, bid in (("run1", "../../etc/passwd"), ("../x", "b0000001")):
        try:
            layout.spool_path(tmp_path, run, bid)
        except ValueError:
            pass
        else:
            raise AssertionError(f"spool_path({run!r}, {bid!r}) was accepted")
