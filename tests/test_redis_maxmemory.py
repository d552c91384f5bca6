"""Redis at its maxmemory with noeviction (the policy hsx requires) refuses every write that adds memory ("OOM
command not allowed"): the roles ride it out as they ride out an outage (issue 37 item 8).

Before: every worker exited at once ("unexpected error: OutOfMemoryError"), the uploader only warned, and after
the limit was lifted the run sat unfinished with spooled files never queued. Here a real `hsx worker` and a real
`hsx upload` run against a private redis-server whose maxmemory is set below its use mid-run, then lifted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter

from hsx.batch import batchfile
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.redisconn import LocalRedis, connect
from hsx_tools.demo import sample_dataset
from tests.pacedworker import PACED_HSX
from tests.pipeline import produce_config
from tests.waiting import scaled, wait_until

RUN, HOST, SAMPLES = "oom", "oomhost", 48
HOLD_SECONDS = 5  # how long Redis stays at its limit once both roles met it: 5 heartbeats (a span held, not a wait)


def _hsx(*argv: str, env: dict, log) -> subprocess.Popen:
    return subprocess.Popen([*PACED_HSX, *argv], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def test_worker_and_uploader_ride_out_redis_at_maxmemory(tmp_path, tiny_model):
    from producer.produce import produce

    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines()]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({**rows[i % len(rows)], "id": f"s{i:03d}"}) + "\n" for i in range(SAMPLES)))
    server = LocalRedis(tmp_path / "redis").start()  # private: its maxmemory is this test's to change
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "uploader")}
    try:
        r = connect(server.url)
        store, spool = tmp_path / "store", tmp_path / "spool"
        produce(produce_config(server.url, tiny_model, str(store), run=RUN, dataset=data, token_budget=256,
                               max_length=256, overlong="truncate", lease_seconds=8))
        keys = RunKeys(RUN)
        batches = len(ledger.all_specs(r, RUN))
        env = {**os.environ, "HSX_REDIS_URL": server.url, "HSX_HEARTBEAT_SECONDS": "1", "HSX_GRACE_SECONDS": "10",
               "HSX_TEST_MIN_BATCH_SECONDS": "0.3", "HSX_MEMORY_SPOOL_BUDGET_GB": "0", "HSX_LOG_EVERY_SECONDS": "600"}
        procs.append(_hsx("worker", "--run", RUN, "--device", "cpu", "--spool-dir", str(spool), "--host", HOST,
                          "--name", "gpu-oom", "--exit-when-complete", env=env, log=open(logs["worker"], "w")))
        procs.append(_hsx("upload", "--spool-dir", str(spool), "--host", HOST, "--name", "upload-oom", env=env,
                          log=open(logs["uploader"], "w")))
        worker, uploader = procs

        def alive():
            for name, proc in zip(logs, procs, strict=True):
                assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{logs[name].read_text()[-3000:]}"

        wait_until("3 batches done", lambda: ledger.done_count(r, RUN) >= 3, 120, check=alive)
        r.config_set("maxmemory", "1")  # below its use: every write that adds memory is refused
        done_at_limit = ledger.done_count(r, RUN)
        named = lambda name: "maxmemory" in logs[name].read_text()  # noqa: E731
        wait_until("both roles met the limit", lambda: named("worker") and named("uploader"), 60, check=alive)
        deadline = time.monotonic() + HOLD_SECONDS
        while time.monotonic() < deadline:  # held: each role keeps trying (heartbeats, the job in hand), alive
            alive()
            time.sleep(0.5)
        assert ledger.done_count(r, RUN) <= done_at_limit + 1  # nothing recorded while Redis refused (one in flight at most)
        r.config_set("maxmemory", "0")
        wait_until("the run complete", lambda: r.get(keys.index_written), 120, progress=lambda: ledger.done_count(r, RUN),
                   check=lambda: uploader.poll() is None or alive())
        assert worker.wait(timeout=scaled(60)) == 0, logs["worker"].read_text()[-3000:]  # --exit-when-complete
        uploader.send_signal(signal.SIGTERM)
        assert uploader.wait(timeout=scaled(60)) == 0, logs["uploader"].read_text()[-3000:]
        assert ledger.done_count(r, RUN) == batches and not ledger.failures(r, RUN) and not ledger.dead_letters(r, RUN)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()
    seen = Counter()
    for path in (store / RUN / "batches").rglob("*.safetensors"):
        seen.update(batchfile.read_batch_bytes(path.read_bytes(), where=str(path)).sample_ids)
    assert len(seen) == SAMPLES and max(seen.values()) == 1
    assert [p for p in spool.rglob("*") if p.is_file()] == []  # every spooled file was queued and uploaded
    for name, path in logs.items():
        text = path.read_text()
        said = [line for line in text.splitlines() if "maxmemory" in line]
        assert len(said) == 1, (name, said)  # one line, not a flood
        assert "unexpected error" not in text and "heartbeat failed" not in text, (name, text[-3000:])


def test_a_command_at_maxmemory_says_so_in_one_line(tmp_path, tiny_model, capsys, monkeypatch):
    """A one-shot command (no ride-out: a person waits at the prompt) names maxmemory and the fix, exit 2."""
    from hsx_cli.main import main

    server = LocalRedis(tmp_path / "redis").start()
    try:
        connect(server.url).config_set("maxmemory", "1")
        monkeypatch.setenv("HSX_REDIS_URL", server.url)
        rc = main(["produce", "--run", "full", "--dataset", str(sample_dataset()), "--model", str(tiny_model),
                   "--store", str(tmp_path / "store"), "--layers", "dflash:3"])
    finally:
        server.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("hsx produce: error: Redis refuses writes: its memory is at maxmemory") and "CONFIG SET" in err[0]
