"""/api/status, /metrics, the retry action and auth, against a real redis-server holding a
ledger in known states: fresh, mid-run, stalled worker, dead letters, finished."""

from __future__ import annotations

import base64
import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rq import Worker

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import heartbeat, ledger, queues
from hsx.life.keys import RunKeys
from hsx.life.ledger import BatchSpec
from hsx.monitor.progress import RATE_WINDOW_SECONDS
from tests.manifests import example_manifest

RUN = "dash"
# Six batches in two shards; batch i has 10 samples and 100 * (i + 1) tokens (2,100 in all).
SPECS = [BatchSpec(batch_id=f"b{i:04d}", index=i, shard="00000" if i < 4 else "00001", samples=10,
                   tokens=100 * (i + 1), padded=128 * (i + 1), padded_len=64, sample_ids=[f"s{i}-{j}" for j in range(10)])
         for i in range(6)]
BY_ID = {s.batch_id: s for s in SPECS}
TOTALS = {"batches": 6, "samples": 60, "tokens": 2100}
BATCH_BYTES = 1000  # size recorded for every uploaded batch
H200 = {"host": "hostA", "device": "cuda:0", "gpu": 0, "name": "NVIDIA H200", "util_pct": 97,
        "mem_used_bytes": 80 * 10**9, "mem_total_bytes": 141 * 10**9, "temp_c": 61, "power_w": 650.5,
        "current_batch": "b0003", "batches": 3, "tokens": 1100, "tokens_per_s": 30000.0}


def plan(r):
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, TOTALS)


def upload(r, *bids):
    for bid in bids:
        ledger.mark_spooled(r, RUN, bid)
        ledger.mark_done(r, RUN, BY_ID[bid], f"{RUN}/batches/{BY_ID[bid].shard}/{bid}.safetensors", BATCH_BYTES,
                         "0" * 64, by="test")


AGE = 120  # seconds since the mid-run's first batch reached a spool: rates are averaged over this


def mid_run(r):
    """b0, b1, b4 uploaded; b2 extracted and waiting on hostA's upload queue; b3 on the GPU; b5 queued.
    The run is AGE seconds old (younger than the rate window)."""
    plan(r)
    upload(r, "b0000", "b0001", "b0004")
    r.zadd(RunKeys(RUN).spooled_log, {"b0000": time.time() - AGE})
    r.hset(RunKeys(RUN).rate_minutes, "spooled:first", int(time.time() - AGE))   # the run's first, as marked then
    ledger.mark_spooled(r, RUN, "b0002")
    queues.enqueue_upload(r, "hostA", RUN, "b0002", "/spool/dash/b0002.safetensors", BATCH_BYTES, "0" * 64, seq=1)
    queues.enqueue_extract(r, RUN, "b0005", seq=1)
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostA-0", H200, ttl_seconds=30)
    heartbeat.publish_host(r, RUN, "hostA", {"spool_bytes": 2500, "spool_files": 1, "spool_budget_bytes": 10000})
    Worker([queues.queue(r, queues.upload_queue_name("hostA"))], connection=r, name="upload-hostA-1").register_birth()
    for b in ("b0000", "b0001"):   # recorded done by hostA's uploaders (b0004 by a host gone since)
        ledger.note_uploaded(r, RUN, "hostA", b, BY_ID[b].tokens, BATCH_BYTES)


@pytest.fixture
def client(r, redis_server):
    return create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()


def status(client, run=RUN):
    res = client.get(f"/api/status?run={run}")
    assert res.status_code == 200, res.data
    return res.json["overview"]


def metrics(client) -> dict[tuple[str, tuple], float]:
    res = client.get("/metrics")
    assert res.status_code == 200 and res.headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(res.data.decode()) for s in fam.samples}


def test_no_runs_yet(client):
    res = client.get("/api/status")
    assert res.status_code == 200 and res.json["runs"] == [] and res.json["overview"] is None
    assert client.get("/api/status?run=nope").status_code == 404
    assert client.get("/").status_code == 200


def test_fresh_run(client, r):
    plan(r)
    for spec in SPECS:
        queues.enqueue_extract(r, RUN, spec.batch_id, seq=1)
    o = status(client)
    assert o["progress"] == {"samples": {"done": 0, "total": 60}, "tokens": {"done": 0, "total": 2100},
                             "batches_extracted": {"done": 0, "total": 6}, "batches_uploaded": {"done": 0, "total": 6}}
    assert o["complete"] is False and o["eta_seconds"] is None and o["extract_queue"] == 6
    assert o["shards"] == [{"shard": "00000", "done": 0, "total": 4}, {"shard": "00001", "done": 0, "total": 2}]
    assert o["rate"]["tokens_per_s"] == 0 and o["workers"] == [] and o["hosts"] == [] and o["dead_letters"] == []
    assert set(o["series"]["uploaded_tokens_per_s"]) == {0} and len(o["series"]["extracted_tokens_per_s"]) == 12
    m = metrics(client)
    assert m[("hsx_planned_tokens", (("run", RUN),))] == 2100
    assert m[("hsx_uploaded_batches_total", (("run", RUN),))] == 0
    assert m[("hsx_extract_queue_jobs", (("run", RUN),))] == 6
    assert ("hsx_eta_seconds", (("run", RUN),)) not in m


def test_mid_run(client, r):
    mid_run(r)
    o = status(client)
    assert o["progress"] == {"samples": {"done": 30, "total": 60}, "tokens": {"done": 800, "total": 2100},
                             "batches_extracted": {"done": 4, "total": 6}, "batches_uploaded": {"done": 3, "total": 6}}
    assert o["uploaded_bytes"] == 3 * BATCH_BYTES and o["extract_queue"] == 1 and not o["complete"]
    assert o["rate"]["window_seconds"] == pytest.approx(AGE, abs=2)
    assert o["rate"]["tokens_per_s"] == pytest.approx(800 / AGE, rel=0.01)
    assert o["rate"]["samples_per_s"] == pytest.approx(30 / AGE, rel=0.01)
    assert o["rate"]["extract_tokens_per_s"] == pytest.approx(1100 / AGE, rel=0.01)
    assert o["eta_seconds"] == pytest.approx(1300 / (800 / AGE), rel=0.01)
    bucket = o["series"]["bucket_seconds"]
    assert sum(o["series"]["uploaded_tokens_per_s"]) * bucket == pytest.approx(800)
    assert sum(o["series"]["extracted_tokens_per_s"]) * bucket == pytest.approx(1100)
    assert o["shards"] == [{"shard": "00000", "done": 2, "total": 4}, {"shard": "00001", "done": 1, "total": 2}]
    [w] = o["workers"]
    assert (w["worker"], w["host"], w["gpu"], w["gpu_name"], w["util_pct"], w["temp_c"], w["power_w"]) == \
        ("gpu-hostA-0", "hostA", 0, "NVIDIA H200", 97, 61, 650.5)
    assert (w["mem_used_bytes"], w["mem_total_bytes"], w["current_batch"], w["batches"]) == (80e9, 141e9, "b0003", 3)
    assert (w["state"], w["activity"]) == ("alive", "busy") and w["heartbeat_age_seconds"] < 5
    [h] = o["hosts"]
    assert (h["host"], h["spool_bytes"], h["spool_files"], h["spool_budget_bytes"], h["spool_fill"]) == \
        ("hostA", 2500, 1, 10000, 0.25)
    assert (h["upload_queue"], h["uploaders"]) == (1, 1)
    assert h["upload_batches_per_s"] == pytest.approx(2 / AGE, rel=0.01)
    assert h["upload_tokens_per_s"] == pytest.approx(300 / AGE, rel=0.01)
    assert h["upload_bytes_per_s"] == pytest.approx(2 * BATCH_BYTES / AGE, rel=0.01)

    m = metrics(client)
    run = (("run", RUN),)
    wl = (("gpu", "0"), ("host", "hostA"), ("run", RUN), ("worker", "gpu-hostA-0"))
    hl = (("host", "hostA"), ("run", RUN))
    assert m[("hsx_uploaded_tokens_total", run)] == 800 and m[("hsx_uploaded_samples_total", run)] == 30
    assert m[("hsx_uploaded_bytes_total", run)] == 3000 and m[("hsx_extracted_batches_total", run)] == 4
    assert m[("hsx_upload_tokens_per_second", run)] == pytest.approx(800 / AGE, rel=0.01)
    assert m[("hsx_eta_seconds", run)] == pytest.approx(o["eta_seconds"], rel=0.01)
    assert m[("hsx_shard_uploaded_batches", (("run", RUN), ("shard", "00000")))] == 2
    assert m[("hsx_shard_planned_batches", (("run", RUN), ("shard", "00001")))] == 2
    assert m[("hsx_worker_up", wl)] == 1 and m[("hsx_worker_busy", wl)] == 1
    assert m[("hsx_gpu_utilization_ratio", wl)] == pytest.approx(0.97)
    assert m[("hsx_gpu_memory_used_bytes", wl)] == 80e9 and m[("hsx_gpu_power_watts", wl)] == 650.5
    assert m[("hsx_gpu_temperature_celsius", wl)] == 61 and m[("hsx_worker_batches_total", wl)] == 3
    assert m[("hsx_spool_bytes", hl)] == 2500 and m[("hsx_spool_budget_bytes", hl)] == 10000
    assert m[("hsx_upload_queue_jobs", hl)] == 1 and m[("hsx_uploaders", hl)] == 1
    assert m[("hsx_run_complete", run)] == 0


def test_rates_of_an_old_run_cover_the_last_five_minutes(client, r):
    mid_run(r)
    r.zadd(RunKeys(RUN).spooled_log, {"b0000": time.time() - 3600})  # started an hour ago, b0 out of the window
    now, then = int(time.time() // 60), int((time.time() - 3600) // 60)   # ... in the per-minute counts too
    r.hset(RunKeys(RUN).rate_minutes, "spooled:first", int(time.time() - 3600))
    for what, n in (("b", 1), ("s", BY_ID["b0000"].samples), ("t", BY_ID["b0000"].tokens)):
        r.hincrby(RunKeys(RUN).rate_minutes, f"spooled:{now}:{what}", -n)
        r.hincrby(RunKeys(RUN).rate_minutes, f"spooled:{then}:{what}", n)
    o = status(client)
    assert o["rate"]["window_seconds"] == RATE_WINDOW_SECONDS
    assert o["rate"]["tokens_per_s"] == pytest.approx(800 / RATE_WINDOW_SECONDS)
    assert o["rate"]["extract_tokens_per_s"] == pytest.approx(1000 / RATE_WINDOW_SECONDS)  # b1, b2, b4
    assert o["eta_seconds"] == pytest.approx(1300 / (800 / RATE_WINDOW_SECONDS))
    assert o["progress"]["batches_extracted"]["done"] == 4


def test_stalled_worker(client, r):
    mid_run(r)
    keys = RunKeys(RUN)
    # gpu-hostB-1: heartbeat expired two minutes ago (key gone). gpu-hostA-0: key alive but 60 s old.
    r.zadd(keys.workers, {"gpu-hostB-1": time.time() - 120})
    r.set(keys.heartbeat("gpu-hostA-0"), json.dumps({**H200, "worker": "gpu-hostA-0", "ts": time.time() - 60}))
    r.zadd(keys.workers, {"gpu-hostA-0": time.time() - 60})
    workers = {w["worker"]: w for w in status(client)["workers"]}
    assert workers["gpu-hostB-1"]["state"] == "lost" and workers["gpu-hostB-1"]["activity"] is None
    assert workers["gpu-hostA-0"]["state"] == "lost" and workers["gpu-hostA-0"]["current_batch"] is None
    assert workers["gpu-hostA-0"]["heartbeat_age_seconds"] >= 59
    m = metrics(client)
    assert m[("hsx_worker_up", (("gpu", ""), ("host", ""), ("run", RUN), ("worker", "gpu-hostB-1")))] == 0
    assert m[("hsx_worker_heartbeat_age_seconds", (("gpu", "0"), ("host", "hostA"), ("run", RUN),
                                                   ("worker", "gpu-hostA-0")))] >= 59
    # An idle worker: fresh heartbeat, no batch in hand.
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostA-0", {**H200, "current_batch": None}, ttl_seconds=30)
    assert {w["worker"]: (w["state"], w["activity"]) for w in status(client)["workers"]} == \
        {"gpu-hostA-0": ("alive", "idle"), "gpu-hostB-1": ("lost", None)}


def test_dead_letters_and_retry(client, r):
    mid_run(r)
    ledger.record_failure(r, RUN, "b0002", "upload: <b>store</b> said 503", max_attempts=3)
    ledger.record_failure(r, RUN, "b0003", "CUDA out of memory", max_attempts=1)
    ledger.record_failure(r, RUN, "b0005", "boom 1", max_attempts=2)
    ledger.record_failure(r, RUN, "b0005", "boom 2", max_attempts=2)
    o = status(client)
    assert [(d["batch_id"], d["attempts"], d["last_error"]) for d in o["dead_letters"]] == \
        [("b0003", 1, "CUDA out of memory"), ("b0005", 2, "boom 2")]
    assert o["retrying"] == 1
    assert {e["batch_id"]: e["dead"] for e in o["recent_errors"]} == {"b0002": False, "b0003": True, "b0005": True}
    assert o["recent_errors"][0]["batch_id"] == "b0005"  # newest first
    m = metrics(client)
    assert m[("hsx_dead_letter_batches", (("run", RUN),))] == 2 and m[("hsx_retrying_batches", (("run", RUN),))] == 1

    extract = queues.queue(r, queues.extract_queue_name(RUN))
    before = extract.count
    res = client.post("/api/retry", json={"run": RUN, "batch_ids": ["b0003", "b0002"]})  # b0002 is not dead
    assert res.status_code == 200 and res.json == {"run": RUN, "retried": ["b0003"]}
    assert extract.count == before + 1 and list(ledger.dead_letters(r, RUN)) == ["b0005"]
    assert client.post("/api/retry", json={"run": RUN}).json["retried"] == ["b0005"]
    assert ledger.dead_letters(r, RUN) == {} and extract.count == before + 2
    assert client.post("/api/retry", json={"run": "nope"}).status_code == 404
    assert client.post("/api/retry", data="run=dash").status_code == 400
    assert client.post("/api/retry", json={"run": RUN}, headers={"Origin": "http://evil.example"}).status_code == 403


def test_finished_run(client, r):
    plan(r)
    upload(r, *BY_ID)
    r.set(RunKeys(RUN).index_written, f"{RUN}/index.jsonl")
    o = status(client)
    assert all(v["done"] == v["total"] for v in o["progress"].values())
    assert o["progress"]["tokens"] == {"done": 2100, "total": 2100}
    assert o["complete"] and o["index_written"] and o["eta_seconds"] == 0
    assert o["shards"] == [{"shard": "00000", "done": 4, "total": 4}, {"shard": "00001", "done": 2, "total": 2}]
    assert sum(o["series"]["uploaded_tokens_per_s"]) * o["series"]["bucket_seconds"] == pytest.approx(2100)
    m = metrics(client)
    assert m[("hsx_run_complete", (("run", RUN),))] == 1 and m[("hsx_eta_seconds", (("run", RUN),))] == 0
    assert m[("hsx_uploaded_batches_total", (("run", RUN),))] == 6


def test_several_runs_and_default_choice(client, r):
    plan(r)
    ledger.save_plan(r, "other", example_manifest("other"), SPECS[:2], {"batches": 2, "samples": 20, "tokens": 300})
    ledger.mark_spooled(r, "other", "b0000")  # the most recent activity: shown by default
    res = client.get("/api/status")
    assert res.json["runs"] == [RUN, "other"] and res.json["overview"]["run"] == "other"
    time.sleep(0.01)
    upload(r, "b0000")  # now the first run's is (its name sorts first: the choice is by activity, not by name)
    assert client.get("/api/status").json["overview"]["run"] == RUN
    assert status(client, RUN)["progress"]["batches_uploaded"]["total"] == 6
    assert {s.labels["run"] for f in text_string_to_metric_families(client.get("/metrics").data.decode())
            if f.name == "hsx_planned_batches" for s in f.samples} == {RUN, "other"}


def test_rq_dashboard_mounted(client, r):
    mid_run(r)
    assert client.get("/rq/").status_code == 200
    queues_json = client.get("/rq/0/data/queues.json").json
    assert {q["name"]: q["count"] for q in queues_json["queues"]} == {f"extract:{RUN}": 1, "upload@hostA": 1}


def test_token_auth(r, redis_server):
    app = create_app(DashboardConfig(redis_url=redis_server.url, token="s3cret-token"), r=r)
    c = app.test_client()
    plan(r)
    for path in ("/", "/api/status", "/metrics", "/rq/", "/static/dashboard.js"):
        assert c.get(path).status_code == 401, path
    assert c.post("/api/retry", json={"run": RUN}).status_code == 401
    assert c.get("/api/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/metrics", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    res = c.get("/?run=dash&token=s3cret-token")  # sets the cookie, drops the token from the URL
    assert res.status_code == 302 and res.headers["Location"] == "/?run=dash"
    for path in ("/", "/api/status", "/rq/"):
        res = c.get(path)
        assert res.status_code == 200 and b"s3cret-token" not in res.data, path


def test_basic_auth_and_redaction(r, redis_server):
    url = redis_server.url.replace("redis://", "redis://:hunter2pw@")
    app = create_app(DashboardConfig(redis_url=url, user="ops", password="pa55word"), r=r)
    c = app.test_client()
    plan(r)
    assert c.get("/api/status").status_code == 401 and "Basic" in c.get("/").headers["WWW-Authenticate"]
    bad = {"Authorization": "Basic " + base64.b64encode(b"ops:wrong").decode()}
    assert c.get("/api/status", headers=bad).status_code == 401
    good = {"Authorization": "Basic " + base64.b64encode(b"ops:pa55word").decode()}
    res = c.get("/api/status", headers=good)
    assert res.status_code == 200 and res.json["redis"].startswith("redis://:***@")
    for path in ("/", "/api/status", "/rq/", "/metrics"):
        body = c.get(path, headers=good).data
        assert b"hunter2pw" not in body and b"pa55word" not in body, path
    assert "pa55word" not in repr(app.extensions["hsx_dashboard"].config)
