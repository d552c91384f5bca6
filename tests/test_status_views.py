"""What `hsx status` and the dashboard say about a plan that stopped halfway and about dead workers
(issue 31 items 1 and 2)."""

from __future__ import annotations

import json
import time

import pytest

from dashboard.app import create_app
from dashboard.config import DashboardConfig
from hsx.run import ledger
from hsx.run.keys import RunKeys
from hsx.run.ledger import BatchSpec
from hsx.run.progress import run_progress, summary_lines
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
