"""Issue 23 item 11: one malformed hsx record in Redis never takes down /api/status, /metrics or `hsx status`.

Each case plants one bad record beside a healthy mid-run (tests.test_dashboard_api.mid_run) and reads
the run through all three views: each answers (200 / exit 0), names the bad record as malformed, and
still shows the healthy numbers. Before: every case was a 500 on /api/status and /metrics and a
traceback from `hsx status`.
"""

from __future__ import annotations

import json
import time

import pytest

from hsx.life import ledger
from hsx.life.keys import RUNS, RunKeys
from hsx_cli.main import main
from tests.manifests import example_manifest
from tests.test_dashboard_api import RUN, client, metrics, mid_run  # noqa: F401 (client is a fixture)

K = RunKeys(RUN)
GARBAGE = {
    "heartbeat not JSON": lambda r: r.set(K.heartbeat("gpu-hostA-0"), b"\x80{not json", ex=30),
    "heartbeat a list": lambda r: r.set(K.heartbeat("gpu-hostA-0"), "[1, 2]", ex=30),
    "heartbeat ts a string": lambda r: r.set(K.heartbeat("gpu-hostA-0"), json.dumps({"ts": "soon", "batches": 1}), ex=30),
    "totals not an integer": lambda r: r.hset(K.totals, "samples", "lots"),
    "counter not an integer": lambda r: r.hset(K.counters, "tokens", "1e9x"),
    "shard counter not an integer": lambda r: r.hset(K.shard_done, "00000", "two"),
    "plan entry not JSON": lambda r: r.hset(K.plan, "b0001", "{{"),
    "plan entry without tokens": lambda r: r.hset(K.plan, "b0004", json.dumps({"samples": 10, "shard": "00001"})),
    "failure record not JSON": lambda r: r.hset(K.failures, "b0005", "oops"),
    "dead letter without attempts": lambda r: r.hset(K.dead, "b0005", json.dumps({"last_error": "x"})),
    "dead letter a number": lambda r: r.hset(K.dead, "b0005", "7"),
    "host stats not JSON": lambda r: r.hset(K.hosts, "hostA", "<html>"),
    "host stats bytes a string": lambda r: r.hset(K.hosts, "hostA", json.dumps({"spool_bytes": "big", "ts": 1})),
    "done record not ours": lambda r: r.hset(K.done_chunk("b00"), "00", "nope"),
    "manifest not JSON": lambda r: r.set(K.manifest, "{manifest"),
    "manifest codec a number": lambda r: r.set(K.manifest, json.dumps({**example_manifest(RUN).to_dict(), "codec": 5})),
    "manifest without its fields": lambda r: r.set(K.manifest, json.dumps({"codec": "none"})),
    "manifest of a newer hsx": lambda r: r.set(K.manifest, json.dumps({**example_manifest(RUN).to_dict(),
                                                                      "format": "hsx-run/9"})),
    # Names that are not UTF-8: read with replacement characters (nothing to skip, nothing to name).
    "run name not UTF-8": lambda r: r.sadd(RUNS, b"\xff\xfe-run"),
    "worker id not UTF-8": lambda r: r.zadd(K.workers, {b"gpu-\xff": time.time()}),
    "done log member not UTF-8": lambda r: r.zadd(K.done_log, {b"b\xff": time.time()}),
    "plan field not UTF-8": lambda r: r.hset(K.plan, b"b\xfe", json.dumps({"samples": 1, "tokens": 1, "shard": "00000"})),
}
NOT_NAMED = {"done record not ours", "run name not UTF-8", "worker id not UTF-8", "done log member not UTF-8",
             "plan field not UTF-8"}  # read only where they add nothing, or read as text
# `hsx status` reads no plan entry (its rates come from per-minute counts, issue 42): the dashboard names these
NOT_IN_STATUS = {"plan entry not JSON", "plan entry without tokens"}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_one_bad_record_is_named_never_a_500(case, r, client, capsys, redis_env):  # noqa: F811 (client fixture)
    mid_run(r)
    GARBAGE[case](r)

    res = client.get(f"/api/status?run={RUN}")
    assert res.status_code == 200, res.data[-500:]
    o = res.json["overview"]
    if case not in NOT_NAMED:
        assert o["malformed"], case
        assert any(key in " ".join(o["malformed"]) for key in (K.heartbeat("gpu-hostA-0"), K.totals, K.counters,
                                                                 K.shard_done, K.plan, K.failures, K.dead, K.hosts,
                                                                 K.manifest)), o["malformed"]
    assert o["progress"]["batches_uploaded"]["done"] == 3 and o["progress"]["batches_uploaded"]["total"] == 6

    m = metrics(client)  # asserts 200
    assert m[("hsx_uploaded_batches_total", (("run", RUN),))] == 3
    assert m[("hsx_malformed_records", (("run", RUN),))] == len(o["malformed"])

    capsys.readouterr()
    assert main(["status", "--run", RUN]) == 0
    out = capsys.readouterr().out
    assert "batches  3/6 done" in out
    if o["malformed"] and case not in NOT_IN_STATUS:
        assert "MALFORMED" in out, out
    assert main(["status", "--run", RUN, "--json"]) == 0
    named = set(json.loads(capsys.readouterr().out)["malformed"])
    assert named == (set() if case in NOT_IN_STATUS else set(o["malformed"]))


def test_a_malformed_dead_letter_is_still_shown_and_retried(r, client):  # noqa: F811 (client fixture)
    mid_run(r)
    r.hset(K.dead, "b0005", "not json")
    o = client.get(f"/api/status?run={RUN}").json["overview"]
    assert [d["batch_id"] for d in o["dead_letters"]] == ["b0005"]
    assert o["dead_letters"][0]["last_error"].startswith("(malformed record: not JSON")
    res = client.post("/api/retry", json={"run": RUN, "batch_ids": ["b0005"]})
    assert res.status_code == 200 and res.json["retried"] == ["b0005"]
    assert ledger.dead_letters(r, RUN) == {}


def test_a_failure_after_a_malformed_record_counts_from_one(r):
    mid_run(r)
    r.hset(K.failures, "b0005", "garbage")
    assert ledger.record_failure(r, RUN, "b0005", "boom", max_attempts=3) == 1  # was: a Lua error
    assert ledger.failures(r, RUN)["b0005"]["attempts"] == 1
