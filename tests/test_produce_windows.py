"""The producer at scale: windows enqueued early, rejects counted and bounded, resume, one producer a run."""

import json
import logging
import os
import socket
import threading

import pytest

from hsx.life import ledger, queues
from hsx.life.keys import RunKeys
from hsx.life.producerlock import LockLost, ProducerBusy, ProducerLock
from hsx_tools.demo import sample_dataset
from producer.produce import produce
from tests.deadpid import a_dead_pid
from tests.pipeline import planned_specs, produce_config

WINDOW = 20   # rows a window: the 160 shipped sample rows make 8 windows


def _queued(r, run) -> list[str]:
    return queues.queue(r, queues.extract_queue_name(run)).get_job_ids()


def _cfg(redis_server, tiny_model, tmp_path, run, **kw):
    kw.setdefault("window_rows", WINDOW)
    return produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=run, **kw)


def _rows(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _sample_rows():
    return [json.loads(line) for line in sample_dataset().read_text().splitlines() if line.strip()]


def test_first_window_is_enqueued_before_the_last_is_tokenised(r, redis_server, tiny_model, tmp_path):
    events = []
    report = produce(_cfg(redis_server, tiny_model, tmp_path, "early"), on_event=lambda *e: events.append(e))
    last = report.windows - 1
    assert report.windows == 8 and report.enqueued == report.batches
    assert events.index(("enqueued", 0)) < events.index(("tokenised", last))
    # Each window is enqueued after it is tokenised, and recorded after it is enqueued.
    for w in range(report.windows):
        assert events.index(("tokenised", w)) < events.index(("enqueued", w)) < events.index(("recorded", w))
    totals = ledger.run_totals(r, "early")
    assert totals["planning"] == 0 and totals["batches"] == report.batches == len(set(_queued(r, "early")))


def test_rejects_are_counted_by_reason_and_quoted_with_row_numbers(r, redis_server, tiny_model, tmp_path):
    good = _sample_rows()[:30]
    data = _rows(tmp_path / "mixed.jsonl", good[:10] + ["{broken", {"id": "x1", "messages": [
        {"role": "user", "content": "q"}]}] + good[10:20] + [{"id": good[0].get("id", "0"), **good[0]}] + good[20:])
    report = produce(_cfg(redis_server, tiny_model, tmp_path, "reasons", dataset=data, max_reject_share=1.0))
    t = report.tokenise
    assert t.rows == 33 and t.kept == 30
    assert t.rejected == {"bad_json": 1, "no_assistant": 1, "duplicate_sample_id": 1}
    text = "\n".join(report.lines())
    assert "row 11: " in text and "row 12 (id x1): " in text and "duplicate sample id" in text
    for code, count in t.rejected.items():
        assert f"rejected {count} x {code}" in text


def test_too_many_rejects_fail_with_nothing_enqueued(r, redis_env, tiny_model, tmp_path, capsys):
    from hsx_cli.main import main

    # The bad rows sit in the last window: earlier windows were enqueued by then and must be taken back.
    data = _rows(tmp_path / "bad-tail.jsonl", _sample_rows() + [{"messages": [{"role": "robot", "content": "x"}]}] * 5)
    args = ["produce", "--dataset", str(data), "--model", str(tiny_model), "--store", str(tmp_path / "store"),
            "--run", "toomany", "--layers", "dflash:3", "--token-budget", "1024", "--max-length", "1024", "--tokenise-workers", "1",
            "--window-rows", str(WINDOW)]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "5 of the 165 rows" in err and "more than --max-reject-share 1.00%" in err and "unknown" in err
    assert _queued(r, "toomany") == []
    assert not r.exists(RunKeys("toomany").windows) and ledger.run_totals(r, "toomany")["planning"] == 1
    # Allowed explicitly, the same dataset plans and enqueues every good row.
    assert main(args + ["--max-reject-share", "0.05"]) == 0
    totals = ledger.run_totals(r, "toomany")
    assert totals["planning"] == 0 and totals["rejected"] == 5
    assert totals["batches"] == len(ledger.all_specs(r, "toomany")) == len(set(_queued(r, "toomany")))


class Killed(Exception):
    pass


def test_a_killed_producer_resumes_where_it_stopped(r, redis_server, tiny_model, tmp_path):
    ref = produce(_cfg(redis_server, tiny_model, tmp_path, "reference"))

    def die(name, window):
        if (name, window) == ("enqueued", 3):   # window 3 queued, not yet recorded
            raise Killed()

    with pytest.raises(Killed):
        produce(_cfg(redis_server, tiny_model, tmp_path, "resume"), on_event=die)
    assert len(ledger.all_specs(r, "resume")) < ref.batches
    events = []
    report = produce(_cfg(redis_server, tiny_model, tmp_path, "resume"), on_event=lambda *e: events.append(e))
    assert report.resumed_windows == 3
    assert min(w for name, w in events if name == "tokenised") == 3     # windows 0-2 are not tokenised again
    queued = _queued(r, "resume")
    assert len(queued) == len(set(queued)) == ref.batches               # each batch queued once
    plan = {bid: spec.sample_ids for bid, spec in planned_specs(r, "resume").items()}
    assert plan and plan == {bid: spec.sample_ids for bid, spec in planned_specs(r, "reference").items()}
    assert report.tokenise.rows == ref.tokenise.rows and report.tokenise.kept == ref.tokenise.kept


def test_two_producers_of_one_run_never_enqueue_twice(r, redis_server, tiny_model, tmp_path):
    outcome = {}

    def second_and_third(name, window):
        if (name, window) != ("enqueued", 0):
            return
        with pytest.raises(ProducerBusy, match="another producer"):     # refuses at once by default
            produce(_cfg(redis_server, tiny_model, tmp_path, "twice"))
        waiter = threading.Thread(target=lambda: outcome.update(third=produce(
            _cfg(redis_server, tiny_model, tmp_path, "twice", lock_wait_seconds=120))))
        waiter.start()
        outcome["thread"] = waiter

    first = produce(_cfg(redis_server, tiny_model, tmp_path, "twice"), on_event=second_and_third)
    outcome["thread"].join(180)
    third = outcome["third"]
    queued = _queued(r, "twice")
    assert first.enqueued == first.batches and third.enqueued == 0
    assert len(queued) == len(set(queued)) == first.batches


def test_a_lock_naming_a_process_of_this_host_that_is_gone_is_taken_over_at_once(r, caplog):
    """A producer SIGKILLed (or OOM-killed) cannot release its lock; the same command again was refused for the
    rest of the lock's 30 s (`hsx run` starts its producer with --lock-wait 0)."""
    key = RunKeys("takeover").producer_lock

    def held_by(host: str, pid: int) -> None:
        r.set(key, json.dumps({"host": host, "pid": pid, "nonce": "n"}), px=30_000)

    held_by(socket.gethostname(), os.getpid())       # alive here (this very process: a thread's produce())
    with pytest.raises(ProducerBusy, match="another producer"):
        ProducerLock(r, "takeover").__enter__()
    held_by("another-host", a_dead_pid())             # a pid of another host says nothing of that host's processes
    with pytest.raises(ProducerBusy, match="another producer"):
        ProducerLock(r, "takeover").__enter__()
    gone = a_dead_pid()
    held_by(socket.gethostname(), gone)
    with caplog.at_level(logging.WARNING, logger="hsx.life.producerlock"), ProducerLock(r, "takeover") as taker:
        taker.check()
    assert f"pid {gone} on {socket.gethostname()}" in caplog.text and "took the lock over" in caplog.text
    assert not r.exists(key)                          # released on the way out, as any holder's


def test_lock_of_a_dead_producer_expires_on_redis_clock(r):
    dead = ProducerLock(r, "lockrun", ttl_ms=1000).__enter__()
    dead._stop.set()                      # it stops refreshing, as a killed process would
    dead._thread.join()
    with pytest.raises(ProducerBusy):
        ProducerLock(r, "lockrun").__enter__()
    with ProducerLock(r, "lockrun", wait_seconds=30) as taker:
        with pytest.raises(LockLost):
            dead.guarded_pipeline()
        taker.check()
        pipe = taker.guarded_pipeline()                 # the lock changes hands between WATCH and EXEC:
        pipe.set("hsx:lockrun:probe", 1)
        r.set(RunKeys("lockrun").producer_lock, "someone else")
        with pytest.raises(LockLost):
            taker.execute(pipe)
        assert not r.exists("hsx:lockrun:probe")     # nothing of the transaction applied
