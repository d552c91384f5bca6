"""Redis memory a run holds per sample (issue 42), and runs an older hsx planned read on today's layout.

The budget test runs bench/redis_scale.py at 100,000 samples (~2,800 batches of ~36 samples, through rq's own
per-job path) and checks the bytes per sample of each stage. Issue 42 asks <= 10 MiB per million samples: the run's
keys (MEMORY USAGE summed: what grows with the run) hold that at every stage, and used_memory holds the figures of
docs/benchmarks.md with room; at 100k samples it carries a fixed ~0.8 MiB the server keeps in no key (client and AOF
buffers grown while rq drives the jobs: ~8 MiB/M at this size, ~0.1 at 10M). A regression of the layout (rq keeping
finished jobs again, the whole plan queued at once, a per-batch record that outlives its batch) fails it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from hsx.life import batchlife, ledger, queues, reconcile
from hsx.life.keys import RunKeys
from hsx.redisconn import text
from hsx.store import open_store
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import produce_config, upload_config, worker_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

# MiB of Redis (used_memory) per million samples, by stage (bench/redis_scale.py at 100k samples measured, main
# 8defc92 -> rq/feeding/done_info (1cbfb10) -> sample ids in the store -> compact plan entries -> the done ledger in
# listpack chunks, logs of LOG_KEEP batches, no done_seq_pos (issue 42 step 2): planned 17.7 -> 17.7 -> 10.0 -> 7.4
# -> 7.4, queued 63.0 -> 22.3 -> 14.5 -> 12.0 -> 12.0, leased 221.8 -> 32.9 -> 25.2 -> 22.6 -> 17.0-17.2, done 377.9
# -> 37.9 -> 30.2 -> 27.7-29.8 -> 15.8-18.0, completed 378.0 -> 38.1 -> 30.4 -> 27.9-29.8 -> 16.1-18.0); of it in the
# run's keys, main 50f9e6a -> step 2: planned 5.7 -> 5.7, queued 9.5 -> 9.5, leased 14.4 -> 9.4, done 18.5 -> 7.9.
BOUND_MIB_PER_M = {"planned": 9, "queued": 14, "leased": 20, "done": 20, "completed": 20}
KEYS_BOUND_MIB_PER_M = 10   # issue 42's bound, on what grows with the run


def test_redis_bytes_per_sample_through_a_run():
    import redis_scale

    report = redis_scale.main(["--samples", "100000", "--no-readers"])
    per_m = {stage: m["mib_per_m"] for stage, m in report["stages"].items()}
    assert per_m.keys() == BOUND_MIB_PER_M.keys()
    over = {s: round(v, 1) for s, v in per_m.items() if v > BOUND_MIB_PER_M[s]}
    assert not over, f"Redis MiB per million samples over the bound {BOUND_MIB_PER_M}: {over}"
    in_keys = {stage: round(m["keys_mib_per_m"], 1) for stage, m in report["stages"].items()}
    assert max(in_keys.values()) <= KEYS_BOUND_MIB_PER_M, f"the run's keys, MiB per million samples: {in_keys}"
    assert report["server_fixed_bytes"] < 2 * 2**20   # what is in no key stays a fixed cost
    done = report["stages"]["completed"]["by_kind"]
    assert not any(kind.startswith(("rq:results", "rq:finished")) for kind in done), done   # rq keeps no finished job
    queued = report["stages"]["queued"]["keys_by_kind"]
    assert queued.get("rq:job", 0) <= 2 * batchlife.QUEUE_AHEAD < report["batches"]   # jobs O(workers), not O(run)


def _finish(redis_url, spool, run):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    run_worker(worker_config(redis_url, spool, run=run))
    run_uploader(upload_config(redis_url, spool))


def _as_main_8defc92_left_it(r, run: str) -> None:
    """Turn a run planned with --no-enqueue into what `hsx produce` of main 8defc92 left: no ``fed`` mark, every
    planned batch's job queued at once, kept an hour once finished."""
    r.delete(RunKeys(run).fed, RunKeys(run).planned_only)
    extract = Queue(queues.extract_queue_name(run), connection=r, serializer=JSONSerializer)
    old_job_timeout = 3600   # rq's job timeout as 8defc92 set it (a job's limit, not this test's)
    for bid in sorted(ledger.all_specs(r, run)):
        extract.enqueue_call(queues.EXTRACT_FUNC, kwargs={"run": run, "batch_id": bid},
                             job_id=queues.extract_job_id(run, bid, 1), timeout=old_job_timeout, result_ttl=3600,
                             failure_ttl=7 * 86400, description=f"extract {run}/{bid}")


def test_a_run_planned_by_the_old_layout_resumes_and_verifies(r, redis_server, tiny_model, tmp_path):
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="old", enqueue=False))
    _as_main_8defc92_left_it(r, "old")
    total = ledger.run_totals(r, "old")["batches"]
    assert batchlife.fed_count(r, "old") is None and reconcile.orphans(r, "old") == set()
    # A producer re-run (a resume after a kill) finds every batch queued already and queues none twice.
    report = produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="old"))
    assert report.enqueued == 0 and len(queues.queue(r, queues.extract_queue_name("old"))) == total
    assert batchlife.fed_count(r, "old") is None   # an old run stays one: no feeding, every job was queued
    _finish(redis_server.url, tmp_path / "spool", "old")
    assert len(ledger.done_ids(r, "old")) == total
    assert verify_run(r, open_store(str(store_dir)), "old").ok


def test_the_queue_is_fed_ahead_not_with_the_whole_plan(r, redis_server, tiny_model, tmp_path, monkeypatch):
    # A run of more batches than QUEUE_AHEAD: the producer queues QUEUE_AHEAD jobs, each lease tops the queue up, a
    # worker in burst mode drains the whole plan.
    monkeypatch.setattr(batchlife, "QUEUE_AHEAD", 4)
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="fed"))
    total = ledger.run_totals(r, "fed")["batches"]
    assert total > 8
    assert len(queues.queue(r, queues.extract_queue_name("fed"))) == 4 and batchlife.fed_count(r, "fed") == 4
    assert reconcile.orphans(r, "fed") == set()   # not fed yet is not lost
    _finish(redis_server.url, tmp_path / "spool", "fed")
    assert len(ledger.done_ids(r, "fed")) == total and batchlife.fed_count(r, "fed") == total
    assert verify_run(r, open_store(str(store_dir)), "fed").ok


def test_a_reconcile_pass_of_a_fed_run_reads_no_whole_key_and_still_finds_every_orphan(r, redis_server, tiny_model,
                                                                                        tmp_path, monkeypatch):
    monkeypatch.setattr(batchlife, "QUEUE_AHEAD", 2)
    monkeypatch.setattr(reconcile, "RECONCILE_CHUNK", 4)
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="ch", enqueue=False))
    keys = RunKeys("ch")
    total = ledger.run_totals(r, "ch")["batches"]
    r.delete(keys.planned_only)
    r.set(keys.fed, total)   # every batch fed and none queued: all orphans (jobs lost)
    r.config_set("slowlog-log-slower-than", 0)   # every command of the pass, with its keys
    r.slowlog_reset()
    try:
        one = reconcile.orphans(r, "ch", advance=True)
        commands = [[text(a) for a in e["command"].split()] for e in r.slowlog_get(1000)]
    finally:
        r.config_set("slowlog-log-slower-than", 10000)
        r.slowlog_reset()
    assert 0 < len(one) <= 4 + 2 * 2   # one chunk and the last 2 x QUEUE_AHEAD fed
    run_sized = {keys.plan, keys.done_chunks, keys.dead, keys.done_seq, keys.done_log}
    whole = [c for c in commands if c[0].lower() in ("hkeys", "hgetall", "hvals", "smembers", "lrange", "zrange",
                                                      "hscan", "sscan") and len(c) > 1 and c[1] in run_sized]
    assert not whole, f"a pass read whole keys of the run: {whole}"
    found = set(one)
    for _ in range(total // 4 + 1):   # the cursor goes round the run
        found |= reconcile.orphans(r, "ch", advance=True)
    assert found == set(ledger.all_specs(r, "ch"))
    for _ in range(2 * (total // 4 + 2)):   # and passes queue every one of them again, each once
        reconcile.reconcile(r, "ch", grace=0)
    assert queues.pending_extract(r, "ch") == set(ledger.all_specs(r, "ch"))
    assert len(queues.queue(r, queues.extract_queue_name("ch"))) == total


def test_a_queue_of_done_batches_still_feeds_the_rest(r, redis_server, tiny_model, tmp_path, monkeypatch):
    # Every job queued is of a batch done meanwhile (a duplicate delivery, a ledger rebuilt from the store): the
    # worker's leases are refused, and each still tops the queue up, so a burst worker drains the whole plan.
    monkeypatch.setattr(batchlife, "QUEUE_AHEAD", 4)
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="dq"))
    specs = ledger.all_specs(r, "dq")
    for bid in sorted(specs)[:4]:   # the four queued ones, recorded done by someone else
        ledger.mark_done(r, "dq", specs[bid], f"elsewhere/{bid}", 1, "0" * 64, by="test")
    _finish(redis_server.url, tmp_path / "spool", "dq")
    assert len(ledger.done_ids(r, "dq")) == len(specs)


def test_the_logs_keep_the_last_hour_and_the_counts_stay_whole(r, monkeypatch):
    from hsx.life.keys import LOG_SECONDS
    from hsx.monitor.progress import run_progress
    from tests.manifests import example_manifest

    specs = [ledger.BatchSpec(f"b{i:07d}", i, "00000", 2, 20, 32, 16, ["a", "b"], "0" * 64) for i in range(3)]
    ledger.save_plan(r, "lg", example_manifest("lg"), specs, {"batches": 3, "samples": 6, "tokens": 60})
    now = time.time()
    for spec, ago in zip(specs, (2 * LOG_SECONDS, 10, 5), strict=True):   # the first one two hours ago
        monkeypatch.setattr(ledger.time, "time", lambda ago=ago: now - ago)
        ledger.mark_spooled(r, "lg", spec.batch_id)
        ledger.mark_done(r, "lg", spec, "k", 1, "0" * 64, by="test")
    monkeypatch.undo()
    keys = RunKeys("lg")
    assert r.zcard(keys.spooled_log) == 2 and r.zcard(keys.done_log) == 2   # the first one trimmed away
    p = run_progress(r, "lg")
    assert p["spooled_batches"] == 3 and p["done"]["batches"] == 3
    assert p["started"] == pytest.approx(now - 2 * LOG_SECONDS, abs=1)
    assert p["rate_span_seconds"] == 300   # the run is older than the window (its first batch two hours ago)
    assert p["rate"]["batches"] == pytest.approx(2 / 300)   # the last five minutes: two batches


def test_verify_repair_queues_every_orphan_of_a_fed_run_at_once(r, redis_server, tiny_model, tmp_path, monkeypatch):
    from hsx.life.integrity import requeue_orphans

    monkeypatch.setattr(batchlife, "QUEUE_AHEAD", 2)
    monkeypatch.setattr(reconcile, "RECONCILE_CHUNK", 4)
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="vr", enqueue=False))
    total = ledger.run_totals(r, "vr")["batches"]
    r.delete(RunKeys("vr").planned_only)
    r.set(RunKeys("vr").fed, total)   # every batch fed, every job lost
    assert total > 4 + 2 * 2 and len(reconcile.orphans(r, "vr")) < total   # a pass sees a part
    assert sorted(requeue_orphans(r, "vr")) == sorted(ledger.all_specs(r, "vr"))   # verify --repair: all of them


def test_the_plan_keeps_the_sample_ids_in_the_store(r, redis_server, tiny_model, tmp_path):
    # issue 42: a plan entry holds the digest of its batch's ids; the ids are in the inputs object and the window's
    # ids object; every reader (worker, index, verify) finds them there.
    from hsx.life import planids

    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="st"))
    store = open_store(str(store_dir))
    raw = {text(k): text(v) for k, v in r.hgetall(RunKeys("st").plan).items()}
    assert raw and all('"sample_ids"' not in v and '"d":' in v for v in raw.values())   # the ids' digest only
    specs = ledger.all_specs(r, "st")
    ids = planids.plan_ids(r, store, "st", specs)
    assert sum(len(v) for v in ids.values()) == ledger.run_totals(r, "st")["samples"]
    assert all(planids.inputs_ids(store, "st", specs[b]) == ids[b] for b in specs)   # inputs headers agree
    assert specs[min(specs)].ids_match(ids[min(specs)]) and not specs[min(specs)].ids_match(ids[min(specs)][::-1] + ["x"])
    _finish(redis_server.url, tmp_path / "spool", "st")
    assert verify_run(r, store, "st").ok
    index = [line for line in store.get_bytes("st/index.jsonl").decode().splitlines() if line]
    assert len(index) == sum(len(v) for v in ids.values())


def test_a_plan_holding_its_sample_ids_still_resumes_finishes_and_verifies(r, redis_server, tiny_model, tmp_path):
    # A plan written before the ids moved to the store (ids in every spec, no window ids objects): the producer's
    # resume (its duplicate check), the worker, verify and the index read the ids from the specs.
    import dataclasses

    from hsx.life import planids

    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="oi", enqueue=False))
    store = open_store(str(store_dir))
    specs = ledger.all_specs(r, "oi")
    ids = planids.plan_ids(r, store, "oi", specs)
    old = {b: dataclasses.replace(s, sample_ids=ids[b], ids_sha256="") for b, s in specs.items()}
    r.hset(RunKeys("oi").plan, mapping={b: s.to_json() for b, s in old.items()})
    for key in store.list_keys("oi/plan/"):
        store.delete(key)
    assert all('"sample_ids"' in text(v) for v in r.hvals(RunKeys("oi").plan))
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="oi"))
    assert all(s.sample_ids for s in ledger.all_specs(r, "oi").values())   # a resumed old plan stays one
    _finish(redis_server.url, tmp_path / "spool", "oi")
    assert len(ledger.done_ids(r, "oi")) == len(specs)
    assert verify_run(r, store, "oi").ok
    assert store.get_bytes("oi/index.jsonl").count(b"\n") == sum(len(v) for v in ids.values())


def test_a_plan_entry_without_its_ids_is_compact_and_every_form_reads():
    import dataclasses
    import hashlib

    ids = [f"row{i}" for i in range(36)]
    full = ledger.BatchSpec("b0001234", 1234, "00012", 36, 32000, 32768, 1114, ids, hashlib.sha256(b"x").hexdigest(),
                            prefix_groups=[[0, 3, 50]], computed=30000)
    planned = full.for_plan()
    raw = planned.to_json()
    assert "row1" not in raw and "b0001234" not in raw
    plain = dataclasses.replace(planned, prefix_groups=[], computed=0).to_json()   # no shared prefixes: most batches
    assert len(plain) <= 156, plain   # a 160-byte allocation in Redis (the long form: 256)
    assert ledger.BatchSpec.from_json(raw, "b0001234") == planned and planned.ids_match(ids)
    assert not planned.ids_match(ids[::-1]) and not planned.ids_match(ids[:-1])
    with pytest.raises(ValueError, match="without its batch id"):
        ledger.BatchSpec.from_json(raw)
    old = full.to_json()   # a plan that holds its ids (an older hsx's) reads as it was written, with or without the field
    assert '"sample_ids"' in old and ledger.BatchSpec.from_json(old) == full == ledger.BatchSpec.from_json(old, "b0001234")
    odd = ledger.BatchSpec("b12", 12, "00000", 1, 5, 8, 8, ["a"], "").for_plan()   # not a canonical batch id: long form
    assert ledger.BatchSpec.from_json(odd.to_json()) == odd


def test_the_first_api_status_and_page_read_no_whole_key_of_the_run(r, redis_server, tiny_model, tmp_path):
    # issue 42: /api/status's first answer read the whole plan (2.47 s at 1M samples); its plan summary is counted
    # from the window records now (O(windows)), the chart from the capped logs and per-minute counts.
    from dashboard.app import create_app
    from dashboard.config import DashboardConfig
    from dashboard.plan_cache import PlanSummary

    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="api", batches_per_shard=2))
    _finish(redis_server.url, tmp_path / "spool", "api")
    keys = RunKeys("api")
    client = create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()
    try:
        res = client.get("/api/status?run=api")
        page = client.get("/?run=api")
        commands = [[text(a) for a in e["command"].split()] for e in r.slowlog_get(10000)]
    finally:
        r.config_set("slowlog-log-slower-than", 10000)
        r.slowlog_reset()
    assert res.status_code == 200 and page.status_code == 200
    run_sized = {keys.plan, keys.done_chunks, keys.done_seq}   # (dead letters are shown whole: O(dead))
    whole = [c for c in commands if c[0].lower() in ("hkeys", "hgetall", "hvals", "smembers", "lrange", "hscan",
                                                      "sscan") and len(c) > 1 and c[1] in run_sized]
    assert not whole, f"the dashboard read whole keys of the run: {whole}"
    shards = {s["shard"]: s["total"] for s in res.json["overview"]["shards"]}
    assert len(shards) > 1 and shards == PlanSummary.from_entries(r, "api").shard_batches   # the plan's own counts
    assert sum(shards.values()) == ledger.run_totals(r, "api")["batches"]
    uploaded = res.json["overview"]["series"]["uploaded_tokens_per_s"]
    # per-bucket rates x the bucket's seconds: the run's tokens, to the token (the rates are floats: 2271.8 x 10
    # came out 22717.999999999996 once)
    assert round(sum(uploaded) * res.json["overview"]["series"]["bucket_seconds"]) == ledger.run_totals(r, "api")["tokens"]
