"""The done ledger's compact layout (issue 42, hsx/life/doneledger.py), and a run an older hsx recorded done.

A run whose ledger main 50f9e6a wrote (the SET ``done``, the JSON HASH ``done_info``, the HASH ``done_seq_pos``) is
refused in one line by every writer and whole-run reader, and converted by `hsx produce`'s resume, after which it
finishes and verifies with each batch done once and in ``done_seq`` once.
"""

from __future__ import annotations

import json

import pytest

from hsx.life import batchlife, ledger, oldledger, reconcile
from hsx.life.keys import RunKeys
from hsx.redisconn import text
from hsx.store import layout, open_store
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.manifests import example_manifest
from tests.pipeline import produce_config, upload_config, worker_config


def _finish(redis_url, spool, run):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    run_worker(worker_config(redis_url, spool, run=run))
    run_uploader(upload_config(redis_url, spool))


def _as_main_50f9e6a_recorded_it(r, run: str) -> dict[str, dict]:
    """Rewrite the run's done ledger as main 50f9e6a's ``mark_done`` wrote it: the SET ``done``, ``done_info``
    {size, sha256} JSON and ``done_seq_pos`` (a batch's place in ``done_seq``); the chunks gone. Returns the
    records."""
    keys = RunKeys(run)
    infos = ledger.done_info(r, run)
    places = {text(b): i for i, b in enumerate(r.lrange(keys.done_seq, 0, -1))}
    r.delete(*(keys.done_chunk(text(c)) for c in r.smembers(keys.done_chunks)), keys.done_chunks)
    r.sadd(keys.done, *infos)
    r.hset(keys.done_info, mapping={b: json.dumps(i, separators=(",", ":")) for b, i in infos.items()})
    r.hset(keys.done_seq_pos, mapping={b: places[b] for b in infos})
    return infos


def _old_unmark(r, run: str, spec) -> None:
    """main 50f9e6a's ``unmark_done``: out of the SET and done_info, counters down, its place in done_seq kept."""
    keys = RunKeys(run)
    size = json.loads(r.hget(keys.done_info, spec.batch_id))["size"]
    r.srem(keys.done, spec.batch_id)
    r.hdel(keys.done_info, spec.batch_id)
    for field, by in (("batches", 1), ("samples", spec.samples), ("tokens", spec.tokens), ("bytes", size)):
        r.hincrby(keys.counters, field, -by)
    r.hincrby(keys.shard_done, spec.shard, -1)


def test_a_run_recorded_done_by_the_old_ledger_is_refused_then_converted_by_produce(r, redis_server, tiny_model,
                                                                                      tmp_path):
    store_dir, run = tmp_path / "store", "old42"
    keys = RunKeys(run)
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run=run))
    _finish(redis_server.url, tmp_path / "spool", run)
    specs = ledger.all_specs(r, run)
    total = len(specs)
    assert total >= 4 and ledger.done_count(r, run) == total
    infos = _as_main_50f9e6a_recorded_it(r, run)
    store = open_store(str(store_dir))
    # Two batches an older `verify --repair` took out (places kept, objects gone); one recorded before done_seq.
    bad = sorted(specs)[1:3]
    for bid in bad:
        _old_unmark(r, run, specs[bid])
        store.delete(layout.batch_key(run, specs[bid].shard, bid))
    unplaced = sorted(specs)[-1]
    r.lrem(keys.done_seq, 0, unplaced)
    r.hdel(keys.done_seq_pos, unplaced)
    order_before = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]

    # Refused, in one line naming what to do, by the readers and writers of the ledger; nothing written.
    for refused in (lambda: verify_run(r, store, run), lambda: ledger.done_ids(r, run),
                    lambda: batchlife.lease(r, run, bad[0], 60),
                    lambda: ledger.mark_done(r, run, specs[bad[0]], "k", 1, "0" * 64, by="test")):
        with pytest.raises(oldledger.OldLedger) as caught:
            refused()
        assert "\n" not in str(caught.value) and "`hsx produce`" in str(caught.value) and run in str(caught.value)
    assert r.scard(keys.done) == total - 2 and not r.exists(keys.done_chunks) and not r.zcard(keys.extract_leases)
    assert "`hsx produce` converts it" in reconcile.off_limits(r, run) and reconcile.reconcile(r, run, grace=0) == []
    # `hsx status` and the dashboard still answer (from the counters, which both layouts keep).
    from dashboard.app import create_app
    from dashboard.config import DashboardConfig
    from hsx.monitor import run_progress, summary_lines

    assert run_progress(r, run)["done"]["batches"] == total - 2 and summary_lines(run_progress(r, run))
    res = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client().get(f"/api/status?run={run}")
    assert res.status_code == 200 and res.json["overview"]["progress"]["batches_uploaded"]["done"] == total - 2

    # `hsx produce` (a resume) converts the ledger and queues the two batches again; the run finishes and verifies.
    report = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run=run))
    assert not oldledger.old_ledger(r, run)
    assert ledger.done_ids(r, run) == set(specs) - set(bad) and report.enqueued == 2
    assert all(ledger.done_record(r, run, b) == {"size": infos[b]["size"], "sha256": infos[b]["sha256"]}
               for b in set(specs) - set(bad))
    seq = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    assert seq == order_before + [unplaced]   # the batch without a place got one; the others kept theirs
    _finish(redis_server.url, tmp_path / "spool", run)
    assert ledger.done_count(r, run) == total and ledger.done_ids(r, run) == set(specs)
    seq = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    assert len(seq) == len(set(seq)) == total   # each batch done once, in the sequence once (the two kept places)
    assert seq == order_before + [unplaced]
    assert verify_run(r, store, run).ok


def test_a_done_chunk_is_a_listpack_and_a_batch_taken_out_keeps_its_place(r):
    run = "lp"
    specs = [ledger.BatchSpec(layout.batch_id(i), i, "00000", 36, 3960, 4096, 128, [], "0" * 64, ids_sha256="0" * 16)
             for i in range(250)]
    ledger.save_plan(r, run, example_manifest(run), specs, {"batches": 250})
    sha = "ab" * 32
    for spec in specs:
        assert ledger.mark_done(r, run, spec, "k", 10**9 + spec.index, sha, by="test")
    keys = RunKeys(run)
    chunks = sorted(text(c) for c in r.smembers(keys.done_chunks))
    assert chunks == ["b00000", "b00001", "b00002"]
    assert all(text(r.object("encoding", keys.done_chunk(c))) == "listpack" for c in chunks)   # compact in Redis
    assert r.hlen(keys.done_chunk("b00001")) == 100
    assert ledger.done_record(r, run, "b0000123") == {"size": 10**9 + 123, "sha256": sha}
    assert not ledger.mark_done(r, run, specs[123], "k", 1, sha, by="test")   # done once
    assert ledger.unmark_done(r, run, specs[123]) and not ledger.unmark_done(r, run, specs[123])
    assert ledger.done_record(r, run, "b0000123") is None and not ledger.is_done(r, run, "b0000123")
    assert ledger.done_count(r, run) == 249 and "b0000123" not in ledger.done_ids(r, run)
    assert ledger.mark_done(r, run, specs[123], "k", 5, sha, by="test")   # done again: its first place kept
    seq = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    assert seq == [s.batch_id for s in specs] and ledger.done_count(r, run) == 250
    assert int(r.hget(keys.counters, "bytes")) == sum(10**9 + s.index for s in specs) - (10**9 + 123) + 5
    r.hset(keys.done_chunk("b00002"), "07", b"not a record")   # planted: read as not done by record readers
    assert ledger.done_record(r, run, "b0000207") is None and "b0000207" not in ledger.done_info(r, run)
    odd = ledger.BatchSpec("x", 0, "00000", 1, 1, 1, 1, ["a"], "")   # an id of 2 characters or fewer
    assert ledger.mark_done(r, run, odd, "k", 3, sha, by="test") and ledger.is_done(r, run, "x")
    assert ledger.done_info(r, run)["x"] == {"size": 3, "sha256": sha}


def test_a_resume_checks_done_objects_by_one_listing_not_a_head_each(r, redis_server, tiny_model, tmp_path,
                                                                      monkeypatch):
    # issue 42: the producer's resume checked every done batch's object with a HEAD (O(run) requests; a local
    # store's HEAD hashes the whole file). One listing with sizes now; a HEAD only where it disagrees with the
    # ledger, and a batch leaves the ledger only if that HEAD finds it missing or of the wrong size.
    from hsx.store.local import LocalStore

    store_dir, run = tmp_path / "store", "lst"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run=run))
    _finish(redis_server.url, tmp_path / "spool", run)
    specs = ledger.all_specs(r, run)
    assert len(specs) >= 4
    gone, cut = sorted(specs)[0], sorted(specs)[2]
    (store_dir / layout.batch_key(run, specs[gone].shard, gone)).unlink()
    path = store_dir / layout.batch_key(run, specs[cut].shard, cut)
    path.write_bytes(path.read_bytes()[:-10])
    heads = []
    real_head = LocalStore.head
    monkeypatch.setattr(LocalStore, "head", lambda self, key: heads.append(key) or real_head(self, key))
    report = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run=run))
    batch_heads = [k for k in heads if "/batches/" in k]
    # (the truncated one again by the rebuild, which checks a present object not in the ledger)
    assert set(batch_heads) == {layout.batch_key(run, specs[b].shard, b) for b in (gone, cut)}
    assert report.repaired == 2 and ledger.done_ids(r, run) == set(specs) - {gone, cut}
    monkeypatch.undo()
    _finish(redis_server.url, tmp_path / "spool", run)
    assert ledger.done_count(r, run) == len(specs) and verify_run(r, open_store(str(store_dir)), run).ok
