"""A follower whose ledger changes under it (issue 29 items 2, 3 and 10): rebuilt after a Redis loss, reset,
rolled back a few seconds (same generation, shorter sequence), restarted for 3 s; and a follower left with
dead letters only. One extracted run is planted into the test's Redis (DUMP/RESTORE) for each test."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from hsx.life import doneledger, ledger
from hsx.life.keys import RunKeys
from hsx.life.reset import apply_reset, plan_reset
from hsx.redisconn import LocalRedis, connect, text
from hsx.store import layout
from hsx_reader import Cursor, ReaderError, RunFollower
from producer.produce import produce
from tests import followsampler
from tests.pipeline import planned_specs, produce_config, run_pipeline
from tests.waiting import scaled

RUN = "fledger"


@pytest.fixture(scope="module")
def extracted(redis_server, tiny_model, tmp_path_factory):
    """A completed run (27 batches, 160 samples): its store, and its Redis keys dumped (to plant again)."""
    work = tmp_path_factory.mktemp("fledger")
    store = str(work / "store")
    r = connect(redis_server.url)
    r.flushall()
    run_pipeline(redis_server.url, tiny_model, store, work / "spool", run=RUN)
    dumped = {key: r.dump(key) for key in r.scan_iter("*")}
    r.flushall()
    return store, dumped


def _plant(r, dumped) -> list[str]:
    r.flushall()
    for key, value in dumped.items():
        r.restore(key, 0, value)
    return [text(b) for b in r.lrange(RunKeys(RUN).done_seq, 0, -1)]


def _expected(r, sequence):
    specs = planned_specs(r, RUN)
    return [sid for bid in sequence for sid in specs[bid].sample_ids]


def _roll_back(r, sequence, keep: int) -> list[str]:
    """Redis as if it lost its last writes: done_seq back to ``keep`` entries (generation kept), the batches after
    them not done; then the pipeline records them done again, in another order. Returns the new sequence."""
    keys, specs = RunKeys(RUN), ledger.all_specs(r, RUN)
    infos = ledger.done_info(r, RUN)
    lost = sequence[keep:]
    for bid in lost:
        ledger.unmark_done(r, RUN, specs[bid])
    r.ltrim(keys.done_seq, 0, keep - 1)
    for bid in lost:   # their places lost with the list's tail: their emptied records go too
        r.hdel(keys.done_chunk(doneledger.slot(bid)[0]), doneledger.slot(bid)[1])
    for bid in lost[1:] + lost[:1]:            # another order: no batch at its old place
        info = infos[bid]
        key = layout.batch_key(RUN, specs[bid].shard, bid)   # the record holds size and SHA-256 only (issue 42)
        ledger.mark_done(r, RUN, specs[bid], key, info["size"], info["sha256"], by="test")
    return [text(b) for b in r.lrange(keys.done_seq, 0, -1)]


def test_a_follower_refuses_a_ledger_rebuilt_or_reset_under_it(r, redis_server, tiny_model, extracted):
    store, dumped = extracted
    # rebuilt: Redis lost, then produce records the store's batches again, in another order
    _plant(r, dumped)
    stream = iter(RunFollower(redis_server.url, RUN, timeout_seconds=5))
    read = [next(stream)["sample_id"] for _ in range(30)]          # a trainer paused here
    r.flushall()
    again = produce(produce_config(redis_server.url, tiny_model, store, run=RUN))
    assert again.rebuilt == again.batches
    with pytest.raises(ReaderError) as refused:
        read += [s["sample_id"] for s in stream]
    message = str(refused.value)
    assert "\n" not in message and "changed under" in message and "rebuilt" in message, (message, len(read))

    # reset: the run's keys gone, then produce plans it again (nothing done yet)
    _plant(r, dumped)
    stream = iter(RunFollower(redis_server.url, RUN, timeout_seconds=5))
    read = [next(stream)["sample_id"] for _ in range(30)]
    apply_reset(r, plan_reset(r, RUN))
    produce(produce_config(redis_server.url, tiny_model, store + "-new", run=RUN))
    with pytest.raises(ReaderError, match="changed under") as refused:
        list(stream)                         # the rest of the batch in hand, then the ledger is looked at
    assert "reset" in str(refused.value)


def test_a_cursor_after_a_redis_rollback_is_refused_on_resume_and_while_following(r, redis_server, extracted):
    _, dumped = extracted
    sequence = _plant(r, dumped)
    samples = list(RunFollower(redis_server.url, RUN, timeout_seconds=5))
    assert [s["sample_id"] for s in samples] == _expected(r, sequence)
    at = next(i for i, s in enumerate(samples) if s["cursor"].startswith("20:0@"))
    saved = samples[at]["cursor"]                      # after the last sample of position 19
    assert Cursor.parse(saved).last == sequence[19] and saved.endswith("/" + sequence[19])
    mid = next(s["cursor"] for s in samples if Cursor.parse(s["cursor"]).position == 5 and Cursor.parse(s["cursor"]).row)

    rolled = _roll_back(r, sequence, keep=12)          # done_seq 27 -> 12, same generation, recorded again
    assert rolled[:12] == sequence[:12] and rolled != sequence
    with pytest.raises(ReaderError) as refused:
        list(RunFollower(redis_server.url, RUN, cursor=saved, timeout_seconds=5))
    message = str(refused.value)
    assert "\n" not in message and "rolled back" in message and sequence[19] in message, message
    # a cursor before the lost tail resumes: none repeated, none skipped
    rest = [s["sample_id"] for s in RunFollower(redis_server.url, RUN, cursor=mid, timeout_seconds=5)]
    full = _expected(r, rolled)
    assert full[full.index(rest[0]) - 1] == next(s["sample_id"] for s in samples if s["cursor"] == mid)
    assert rest == full[full.index(rest[0]):]

    # while following: a follower at position 20 when Redis rolls back
    sequence = _plant(r, dumped)
    stream = iter(RunFollower(redis_server.url, RUN, timeout_seconds=5))
    while Cursor.parse(next(stream)["cursor"]).position < 20:
        pass
    _roll_back(r, sequence, keep=15)
    with pytest.raises(ReaderError, match="rolled back"):
        list(stream)


def test_a_follower_given_a_url_rides_out_a_redis_restart(r, extracted, tmp_path):
    _, dumped = extracted
    sequence = _plant(r, dumped)
    private = LocalRedis(tmp_path / "redis").start()
    try:
        own = connect(private.url)
        for key, value in dumped.items():
            own.restore(key, 0, value)
        own.close()
        stream = iter(RunFollower(private.url, RUN, timeout_seconds=30))
        read = [next(stream)["sample_id"] for _ in range(40)]
        private.stop()                                   # Redis restarts: down for 3 s
        back = threading.Timer(3.0, private.start)
        back.start()
        started = time.monotonic()
        read += [s["sample_id"] for s in stream]
        back.join()
        assert time.monotonic() - started >= 2.5
    finally:
        private.stop()
    assert read == _expected(r, sequence)


def _kill_one(r, sequence) -> str:
    """A batch that failed its last attempt: not done, a dead letter."""
    keys, bid = RunKeys(RUN), sequence[-3]
    ledger.unmark_done(r, RUN, ledger.get_spec(r, RUN, bid))
    r.lrem(keys.done_seq, 0, bid)
    r.hdel(keys.done_chunk(doneledger.slot(bid)[0]), doneledger.slot(bid)[1])
    r.hset(keys.dead, bid, '{"attempts": 3, "last_error": "planted", "ts": 0}')
    return bid


def test_a_follower_at_a_dead_letter_says_so_and_skips_or_stops_as_asked(r, redis_server, extracted, caplog):
    _, dumped = extracted
    sequence = _plant(r, dumped)
    dead = _kill_one(r, sequence)
    caplog.set_level(logging.WARNING, logger="hsx_reader.follow")
    with pytest.raises(ReaderError, match="no batch recorded done"):
        list(RunFollower(redis_server.url, RUN, poll_seconds=0.05, notice_seconds=0.2, timeout_seconds=1))
    lines = [m for m in caplog.messages if "waited" in m]
    assert lines and all(dead in m and "retry-failed" in m and "\n" not in m for m in lines), caplog.messages

    with pytest.raises(ReaderError) as stopped:
        list(RunFollower(redis_server.url, RUN, poll_seconds=0.05, on_dead_letter="stop"))
    assert dead in str(stopped.value) and "\n" not in str(stopped.value)

    caplog.clear()
    skipped = [s["sample_id"] for s in RunFollower(redis_server.url, RUN, poll_seconds=0.05, on_dead_letter="skip")]
    assert skipped == _expected(r, [b for b in sequence if b != dead])
    assert any(dead in m and "skip" in m for m in caplog.messages), caplog.messages
    with pytest.raises(ReaderError, match="on_dead_letter"):
        RunFollower(redis_server.url, RUN, on_dead_letter="ignore")




@pytest.mark.slow
def test_speculators_follow_sampler_refuses_a_resume_after_a_rollback(r, redis_server, extracted, tmp_path):
    """speculators' follow sampler notes the run batch of each position it hands out (hsx_follow_seq.txt): a
    resume after Redis lost its last writes (same generation, the tail recorded again in another order) is
    refused in one line instead of training other samples at the resumed step."""
    import json
    import subprocess

    from tests.peerenv import peer_env, peer_python

    _, dumped = extracted
    sequence = _plant(r, dumped)
    python, state = peer_python("speculators"), tmp_path / "ckpt"

    def sampler(start):
        out = subprocess.run([str(python), "-c", followsampler.SCRIPT, redis_server.url, RUN, str(state), str(start)],
                             env=peer_env(tmp_path), capture_output=True, text=True, timeout=scaled(300))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    steps = sampler(0)["steps"]
    assert (state / "hsx_follow_seq.txt").read_text().split() == sequence
    start = next(i for i, step in enumerate(steps) if step[0][0] == sequence[22])     # a step of position 22
    assert sampler(start)["steps"] == steps[start:]                                    # same ledger: resumes
    _roll_back(r, sequence, keep=12)
    refused = sampler(start)["refused"]
    assert "\n" not in refused and "rolled back" in refused and str(state) in refused, refused
