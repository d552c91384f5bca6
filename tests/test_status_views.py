"""What `hsx status` and the dashboard say about a plan that stopped halfway and about dead workers
(issue 31 items 1 and 2)."""

from __future__ import annotations

import json
import time

import pytest

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.life.ledger import BatchSpec
from hsx.monitor.progress import run_progress, summary_lines
from hsx_cli.main import main
from tests.manifests import example_manifest

RUN = "half"
SPECS = [BatchSpec(batch_id=f"b{i:04d}", index=i, shard="00000", samples=10, tokens=100, padded=128, padded_len=64,
                   sample_ids=[f"s{i}-{j}" for j in range(10)]) for i in range(4)]


@pytest.fixture
def client(r, redis_server):
    return create_app(DashboardConfig(redis_url=redis_server.url), r=r).test_client()


def half_planned(r, **manifest_changes):
    """A producer planned one window of two (4 batches, 40 of 80 rows), two batches are done, and it died."""
    ledger.save_plan(r, RUN, example_manifest(RUN, **manifest_changes), SPECS,
                     {"batches": 4, "samples": 40, "tokens": 400, "rows": 40, "planning": 1})
    r.hset(RunKeys(RUN).windows, "0", json.dumps({"batches": 4}))
    for spec in SPECS[:2]:
        ledger.mark_spooled(r, RUN, spec.batch_id)
        ledger.mark_done(r, RUN, spec, f"{RUN}/batches/00000/{spec.batch_id}.safetensors", 1000, "0" * 64, by="t")


def test_status_says_a_killed_producer_left_the_plan_unfinished_and_how_to_resume(r, redis_env, capsys):
    half_planned(r, token_budget=2048, store_dtype="float8_e4m3")
    p = run_progress(r, RUN)
    assert p["eta_seconds"] is None and not p["complete"]  # a rate exists, but the total is not known
    assert p["planning"]["producer"] is None and p["planning"]["windows"] == 1
    assert main(["status", "--run", RUN]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run {RUN}: in progress, plan unfinished (totals are what is planned so far)", out
    line = next(x for x in out.splitlines() if x.startswith("  PLANNING"))
    assert "4 batches from 40 rows (1 windows) planned so far, and no producer holds the run" in line, line
    command = line.split("resume it with: ", 1)[1]
    assert command == (f"hsx produce --run {RUN} --dataset /data/rows.jsonl --model /models/tiny --layers dflash:3 "
                       "--store /tmp/hsx-test-store --max-length 512 --token-budget 2048 --max-batch-rows 64 "
                       "--store-dtype float8_e4m3"), command
    assert "  ETA      unknown (until the plan is whole)" in out


def test_status_and_dashboard_name_the_producer_that_is_still_planning(r, redis_env, capsys, client):
    half_planned(r)
    r.set(RunKeys(RUN).producer_lock, json.dumps({"host": "plannerhost", "pid": 4242, "nonce": "x"}), px=30_000)
    lines = summary_lines(run_progress(r, RUN))
    assert any(x.startswith("  PLANNING unfinished: 4 batches from 40 rows (1 windows) planned so far; producer "
                            "pid 4242 on host plannerhost is planning") for x in lines), lines
    o = client.get(f"/api/status?run={RUN}").json["overview"]
    assert o["eta_seconds"] is None and o["planning"]["producer"] == {"host": "plannerhost", "pid": 4242}
    assert o["planning"]["line"].startswith("PLANNING unfinished: ")
    r.delete(RunKeys(RUN).producer_lock)
    o = client.get(f"/api/status?run={RUN}").json["overview"]
    assert "resume it with: hsx produce --run half " in o["planning"]["line"]
    # The plan made whole: no planning record, an ETA again.
    r.hset(RunKeys(RUN).totals, "planning", 0)
    r.zadd(RunKeys(RUN).done_log, {"b0000": time.time() - 30})
    p = run_progress(r, RUN)
    assert p["planning"] is None and p["eta_seconds"] is not None


def test_a_dead_worker_keeps_who_it_was_and_what_was_reclaimed_from_it(r, redis_env, client, capsys):
    from hsx.life import batchlife, heartbeat

    keys = RunKeys(RUN)
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 4, "samples": 40, "tokens": 400})
    dead_stats = {"host": "hostW", "device": "cuda:1", "gpu": 1, "name": "NVIDIA H200", "batches": 28,
                  "tokens": 2800, "tokens_per_s": 100.0, "current_batch": "b0001"}
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostW-1", dead_stats, ttl_seconds=30)
    heartbeat.publish_current(r, RUN, "gpu-hostW-1", "b0002")  # leased after its last beat
    r.delete(keys.heartbeat("gpu-hostW-1"))  # killed: its heartbeat expired
    # A live worker whose last beat named a batch it has finished since; it holds b0003 now.
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostA-0", {**dead_stats, "host": "hostA", "current_batch": "b0000"},
                                ttl_seconds=30)
    heartbeat.publish_current(r, RUN, "gpu-hostA-0", "b0003")
    r.zadd(keys.extract_leases, {"b0002": 1.0, "b0003": 1e12})  # b0002's lease long expired, b0003's held
    spec0 = SPECS[0]
    ledger.mark_done(r, RUN, spec0, f"{RUN}/batches/00000/b0000.safetensors", 1000, "0" * 64, by="t")

    workers = {w["worker"]: w for w in run_progress(r, RUN)["workers"]}
    dead = workers["gpu-hostW-1"]
    assert not dead["alive"] and dead["host"] == "hostW" and dead["batches"] == 28 and dead["name"] == "NVIDIA H200"
    assert dead["last_batch"] == "b0002" and dead["current_batch"] is None
    assert workers["gpu-hostA-0"]["current_batch"] == "b0003"  # not the done b0000 of its last beat

    assert batchlife.reap(r, RUN, max_attempts=3, now=1000.0)["extract"] == ["b0002"]
    error = ledger.failures(r, RUN)["b0002"]["last_error"]
    assert error.startswith("worker lost: gpu-hostW-1 on host hostW stopped beating while it held the batch"), error
    ledger.mark_done(r, RUN, SPECS[2], f"{RUN}/batches/00000/b0002.safetensors", 1000, "0" * 64, by="t")

    o = client.get(f"/api/status?run={RUN}").json["overview"]
    row = next(w for w in o["workers"] if w["worker"] == "gpu-hostW-1")
    assert row["host"] == "hostW" and row["gpu_name"] == "NVIDIA H200" and row["batches"] == 28
    assert row["last_batch"] == "b0002" and row["reclaimed"] == ["b0002"] and row["state"] == "lost"
    from hsx.life import errorlog
    assert [e.get("lost_worker") for e in errorlog.recent_failures(r, RUN) if e["batch"] == "b0002"] == ["gpu-hostW-1"]
    recent = {e["batch_id"]: e for e in o["recent_errors"]}
    assert recent["b0002"]["resolved"] and recent["b0002"]["last_error"] == error  # done since, still in sight
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'hsx_worker_batches_total{gpu="1",host="hostW",run="half",worker="gpu-hostW-1"} 28.0' in metrics, metrics
    assert main(["status", "--run", RUN]) == 0
    assert ("    lost gpu-hostW-1 on host hostW: 28 batches extracted, as of its last heartbeat; last batch b0002"
            in capsys.readouterr().out)
    # Swept a day after its last beat: gone from every view, its records too.
    r.zadd(keys.workers, {"gpu-hostW-1": time.time() - 2 * 86400})
    assert heartbeat.sweep_heartbeats(r, RUN) == ["gpu-hostW-1"]
    assert not r.hexists(keys.worker_last, "gpu-hostW-1") and not r.hexists(keys.worker_batch, "gpu-hostW-1")


def test_alive_stopped_and_lost_workers_have_one_word_each_in_every_view(r, redis_env, client, capsys):
    """Issue 41 item 7: `hsx status` called a cleanly stopped worker "stale", the word for a killed one, and the
    dashboard called both "stopped". One word a state in the text, --json, /api/status and /metrics: alive (a
    fresh heartbeat), stopped (said goodbye: its final count stands), lost (its heartbeat ran out). And which
    count is which: a worker's count (what it extracted, as of its last report) against the run's (verified)."""
    from hsx.life import heartbeat, queues
    from tests.toyrole.runtime import ADD_FUNC, TallyConfig, TallyRuntime

    keys = RunKeys(RUN)
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 4, "samples": 40, "tokens": 400})
    stats = {"host": "hostA", "device": "cuda:0", "gpu": 0, "batches": 5, "tokens": 500, "tokens_per_s": 10.0}
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostA-0", stats, ttl_seconds=30)
    heartbeat.publish_heartbeat(r, RUN, "gpu-hostK-0", {**stats, "host": "hostK", "batches": 51}, ttl_seconds=30)
    r.delete(keys.heartbeat("gpu-hostK-0"))                       # killed: its heartbeat ran out
    q = queues.queue(r, f"tally:{RUN}")
    for n in (1, 2, 3):
        q.enqueue_call(ADD_FUNC, kwargs={"run": RUN, "n": n})
    role = TallyRuntime(TallyConfig(run=RUN, redis_url="unused", host="hostS", worker_name="tally-stopped", burst=True,
                                    heartbeat_seconds=60.0, log_every_seconds=60.0), r)
    role.serve()  # a real role, stopped cleanly after 3 jobs, before its first beat (60 s away)

    states = {w["worker"]: (w["state"], w.get("batches")) for w in run_progress(r, RUN)["workers"]}
    assert states == {"gpu-hostA-0": ("alive", 5), "gpu-hostK-0": ("lost", 51), "tally-stopped": ("stopped", 3)}
    assert main(["status", "--run", RUN, "--json"]) == 0
    listed = {w["worker"]: w["state"] for w in json.loads(capsys.readouterr().out)["workers"]}
    assert listed == {"gpu-hostA-0": "alive", "gpu-hostK-0": "lost", "tally-stopped": "stopped"}
    assert main(["status", "--run", RUN]) == 0
    out = capsys.readouterr().out
    assert "  workers  1 alive, 1 stopped, 1 lost (a worker's count: batches it extracted, as of its last report; " \
           "the run's: batches verified in the store)" in out, out
    assert "    stopped tally-stopped on host hostS: 3 batches extracted, as of its stop" in out, out
    assert "    lost gpu-hostK-0 on host hostK: 51 batches extracted, as of its last heartbeat" in out, out
    assert "stale" not in out, out
    rows = {w["worker"]: w for w in client.get(f"/api/status?run={RUN}").json["overview"]["workers"]}
    assert {name: row["state"] for name, row in rows.items()} == listed
    assert rows["gpu-hostA-0"]["activity"] == "idle" and rows["tally-stopped"]["activity"] is None
    metrics = client.get("/metrics").get_data(as_text=True)
    assert 'hsx_worker_up{gpu="",host="hostS",run="half",worker="tally-stopped"} 0.0' in metrics, metrics
    assert 'hsx_worker_up{gpu="0",host="hostA",run="half",worker="gpu-hostA-0"} 1.0' in metrics, metrics


def test_the_dashboard_reads_who_a_batch_was_reclaimed_from_in_the_record_and_in_an_older_hsx_s_text(r, client):
    """The reaper's record names the lost worker in a field (``lost_worker``), read as is, whatever its error
    text says; a record of an older hsx, without the field, still reads from its text."""
    from hsx.life import errorlog, heartbeat

    keys = RunKeys(RUN)
    ledger.save_plan(r, RUN, example_manifest(RUN), SPECS, {"batches": 4, "samples": 40, "tokens": 400})
    for name in ("gpu-new-0", "gpu-old-0"):
        heartbeat.publish_stopped(r, RUN, name, {"host": "h", "batches": 1, "tokens": 10, "tokens_per_s": 1.0})
    errorlog.append(r, RUN, "b0000", "lease expired; reclaimed", 1, lost_worker="gpu-new-0")     # any words
    r.lpush(keys.error_log, json.dumps({"batch": "b0001", "attempts": 1, "ts": 1.0,                 # an older hsx's
                                        "error": "worker lost: gpu-old-0 on host h stopped beating while it held the "
                                                 "batch (lease expired without heartbeat); reclaimed"}))
    rows = {w["worker"]: w["reclaimed"] for w in client.get(f"/api/status?run={RUN}").json["overview"]["workers"]}
    assert rows == {"gpu-new-0": ["b0000"], "gpu-old-0": ["b0001"]}
