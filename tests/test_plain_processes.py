"""Plain processes on several terminals or hosts (issue 20): each case's message, exit code and time to answer."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from hsx.redisconn import OUTAGES, LocalRedis, connect
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from tests.pacedworker import paced_extractor
from tests.test_cli_errors import free_port, hsx, one_error_line
from tests.waiting import scaled, wait_until


def test_abbreviated_flag_is_refused_with_the_near_flag(capsys):
    t0 = time.monotonic()
    code = main(["inspect", "--store", "x", "--dataset", "d", "--model", "m"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("hsx inspect: error: unknown flag --store (did you mean --store-dtype?); flags are never "
                   "abbreviated (hsx inspect --help lists them)")
    assert time.monotonic() - t0 < 5


def test_redis_url_without_a_scheme_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("HSX_REDIS_URL", "127.0.0.1:6379")
    assert main(["status"]) == 2
    line = one_error_line(capsys, "status")
    assert line == ("hsx status: error: Redis URL '127.0.0.1:6379' needs a scheme: redis://, rediss:// (TLS) or "
                    "unix://, e.g. redis://127.0.0.1:6379")


def test_status_into_a_closed_pipe_is_not_an_error(r, redis_env, tmp_path):
    for n in range(200):  # enough runs that status writes more than a pipe buffer
        r.sadd("hsx:runs", f"run{n}")
        r.set(f"hsx:run{n}:manifest", json.dumps({"run": f"run{n}"}))
    proc = subprocess.Popen(f"{sys.executable} -m hsx_cli.main status | head -1", shell=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ)
    out, err = proc.communicate(timeout=scaled(120))
    assert out.strip(), err
    assert "unexpected error" not in err and "BrokenPipe" not in err and "Traceback" not in err, err


def test_unreachable_redis_answers_within_10_seconds_of_wall_time():
    t0 = time.monotonic()
    out = hsx("status", env={"HSX_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}, seconds=60)
    took = time.monotonic() - t0
    assert out.returncode == 2 and "cannot reach Redis" in out.stderr, out.stderr
    assert took < 10.5, f"answered after {took:.1f} s"


def test_budget_below_max_length_is_refused_before_anything_is_written(tmp_path, capsys, redis_env, r):
    store = tmp_path / "store"
    t0 = time.monotonic()
    code = main(["produce", "--dataset", str(sample_dataset()), "--model", "no/such-model", "--store", str(store),
                 "--run", "b", "--token-budget", "1024"])
    assert code == 2
    assert one_error_line(capsys, "produce").endswith(
        "--max-length 4096 exceeds --token-budget 1024: a sample that long "
        "would fit no batch; raise --token-budget to at least 4096 or lower --max-length to 1024")
    assert time.monotonic() - t0 < 5
    assert not store.exists() and not r.keys("hsx:b:*")


def test_inspect_shares_produce_checks_and_exit_codes(tmp_path, capsys):
    assert main(["inspect", "--dataset", str(tmp_path / "nope.jsonl"), "--model", "m"]) == 2
    assert one_error_line(capsys, "inspect").endswith(f"dataset {tmp_path / 'nope.jsonl'} does not exist "
                                                      "(--dataset / HSX_DATASET)")
    assert main(["inspect", "--dataset", str(sample_dataset()), "--model", "m", "--token-budget", "512"]) == 2
    assert "exceeds --token-budget 512" in one_error_line(capsys, "inspect")
    assert main(["inspect", "--dataset", str(sample_dataset()), "--model", str(tmp_path / "no-model")]) == 2
    assert f"model path {tmp_path / 'no-model'} does not exist" in one_error_line(capsys, "inspect")


def test_inspect_with_every_row_rejected_exits_2(tmp_path, capsys, tiny_model):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"no chat here {n}"}) for n in range(5)) + "\n")
    assert main(["inspect", "--dataset", str(data), "--model", str(tiny_model), "--layers", "1,2", "--samples", "0",
                 "--tokenise-workers", "1"]) == 2
    assert "no usable rows out of 5; nothing to plan" in one_error_line(capsys, "inspect")


def test_relative_paths_are_absolute_in_the_manifest_and_a_run_can_be_reset(tmp_path, monkeypatch, capsys, r,
                                                                             redis_env, tiny_model):
    a = tmp_path / "a"
    a.mkdir()
    (a / "data.jsonl").write_bytes(sample_dataset().read_bytes())
    os.symlink(tiny_model, a / "model")
    monkeypatch.chdir(a)
    argv = ["produce", "--dataset", "data.jsonl", "--model", "model", "--layers", "1,2", "--store", "relstore", "--run", "rel",
            "--tokenise-workers", "1"]
    assert main(argv) == 0
    manifest = r.get("hsx:rel:manifest")
    m = json.loads(manifest)
    assert m["store_url"] == str(a / "relstore") and m["store"]["url"] == str(a / "relstore")
    assert m["dataset"] == str(a / "data.jsonl") and m["model"] == str(tiny_model.resolve())
    capsys.readouterr()
    # Other settings for the same run: refused, and the refusal says how to start over.
    assert main([*argv, "--max-length", "1024", "--token-budget", "2048"]) == 2
    assert "hsx reset --run rel --store STORE" in capsys.readouterr().err
    assert main(["reset", "--run", "rel", "--store", "relstore"]) == 2  # no terminal to ask: refused
    assert "pass --yes to confirm" in one_error_line(capsys, "reset") and r.exists("hsx:rel:manifest")
    assert main(["reset", "--run", "rel", "--store", "relstore", "--yes"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("reset run rel: ") and f"objects under {a / 'relstore'}/rel/: removed" in out, out
    assert not r.keys("hsx:rel:*") and not list((a / "relstore").rglob("*.safetensors"))
    assert not (a / "relstore" / "rel").exists()  # no empty inputs/00000 left behind (issue 31 item 8)
    assert main([*argv, "--max-length", "1024", "--token-budget", "2048"]) == 0


def test_a_role_client_rides_out_a_redis_outage_with_one_line_each_way(tmp_path, caplog):
    port = free_port()
    server = LocalRedis(tmp_path / "redis", port=port).start()
    try:
        r = connect(server.url, ride_out=True)
        r.set("k", 1)
        server.stop()
        got = {}
        caplog.set_level(logging.WARNING, logger="hsx.redisconn")
        worker = threading.Thread(target=lambda: got.setdefault("v", r.incr("k")), daemon=True)
        worker.start()
        time.sleep(25)  # past the 20 retries (about 3 minutes at full backoff) of a plain client's first tries
        assert worker.is_alive() and "v" not in got
        server = LocalRedis(tmp_path / "redis", port=port).start()
        worker.join(timeout=scaled(30))
        assert got.get("v") == 2  # the AOF kept k; the call in hand went through
        # Just back: leases and heartbeats of live processes look expired; no reaping for a lease's length.
        assert OUTAGES.settling(server.url, 60) and not OUTAGES.settling(server.url, 0)
        assert not OUTAGES.settling(f"redis://127.0.0.1:{free_port()}/0", 60)
    finally:
        server.stop()
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "hsx.redisconn"]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"Redis at {server.url} lost (") and "waiting for it as long as it takes" in lines[0]
    assert lines[1].startswith(f"Redis at {server.url} is back after an outage of ")
    assert 20 <= float(lines[1].split("outage of ")[1].split(" s")[0]) <= 60


@pytest.mark.parametrize("flag", ["--stor", "--burs"])
def test_near_miss_flags_are_suggested(flag, capsys):
    assert main(["upload", flag]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_uploader_with_another_spool_counts_refuses_and_status_names_the_cause(tmp_path, r, redis_server, tiny_model,
                                                                                caplog):
    from gpu_worker.worker import run_worker
    from hsx.life import ledger, queues
    from hsx.monitor.progress import run_progress, summary_lines
    from producer.produce import produce
    from tests.pipeline import produce_config, upload_config, worker_config
    from uploader.runtime import UploadsRefused
    from uploader.worker import run_uploader

    url = redis_server.url
    produce(produce_config(url, tiny_model, str(tmp_path / "store"), run="sm"))
    run_worker(worker_config(url, tmp_path / "spool-a", run="sm"))
    waiting = len(queues.queue(r, queues.upload_queue_name("testhost")))
    assert waiting > 0
    caplog.set_level(logging.ERROR, logger="uploader")
    t0 = time.monotonic()
    with pytest.raises(UploadsRefused, match=r"upload job\(s\) refused on host testhost \(spool mismatch\)"):
        run_uploader(upload_config(url, tmp_path / "spool-b"))
    assert time.monotonic() - t0 < 20
    refusals = [rec.getMessage() for rec in caplog.records if "uploads refused" in rec.getMessage()]
    assert len(refusals) == 1 and refusals[0].startswith("uploads refused: spool mismatch on host testhost: ")
    assert "--spool-dir / HSX_SPOOL_DIR must be the spool of the workers of host testhost" in refusals[0]
    # Nothing failed, nothing is extracted again: the jobs wait on the queue for a right uploader.
    assert len(queues.queue(r, queues.upload_queue_name("testhost"))) == waiting
    assert not ledger.failures(r, "sm") and not ledger.dead_letters(r, "sm")
    assert len(queues.queue(r, queues.extract_queue_name("sm"))) == 0
    p = run_progress(r, "sm")
    assert p["stalled"] == "uploads refused: spool mismatch on host testhost"
    assert any(line.startswith("  REFUSED  1 upload jobs on host testhost: ") for line in summary_lines(p))
    run_uploader(upload_config(url, tmp_path / "spool-a"))  # the right spool: the run completes, the cause is gone
    p = run_progress(r, "sm")
    assert p["complete"] and not p["upload_refused"] and not p["stalled"]


def test_worker_that_cannot_see_the_run_store_says_so_in_one_line(tmp_path, r, redis_server, tiny_model):
    from gpu_worker.worker import run_worker
    from hsx.runspec.visibility import RunNotVisible
    from producer.produce import produce
    from tests.pipeline import produce_config, worker_config

    store = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store), run="vis"))
    store.rename(tmp_path / "elsewhere")
    with pytest.raises(RunNotVisible) as err:
        run_worker(worker_config(redis_server.url, tmp_path / "spool", run="vis", host="h3"))
    assert str(err.value) == (f"this worker cannot see the run's store {store} from host h3 (no vis/manifest.json "
                              "there): mount it at that path or use S3")
    assert not store.exists()  # nothing created at the unseen path


def test_worker_and_uploader_ride_out_a_redis_outage_with_a_batch_in_hand(tmp_path, tiny_model, caplog, monkeypatch):
    """A real redis-server (AOF) stopped mid-batch for 20 s and restarted: the roles neither exit nor lose the
    batch; each process logs one line when Redis is lost and one when it is back."""
    from gpu_worker import worker
    from gpu_worker.worker import run_worker
    from hsx.life import ledger
    from hsx.life.keys import RunKeys
    from producer.produce import produce
    from tests.pipeline import produce_config, upload_config, worker_config
    from uploader.worker import run_uploader

    port = free_port()
    servers = [LocalRedis(tmp_path / "redis", port=port).start()]
    url = servers[0].url
    outage = {}
    dataset = tmp_path / "data.jsonl"   # 24 rows: 15 batches of 256 tokens, each stretched to 1 s
    dataset.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:24]))

    def stop_and_restart():  # rq runs only in the main thread: the outage is made from this one
        watch, leases = connect(url), RunKeys("out").extract_leases   # mid-run: once the worker holds a batch
        wait_until("the worker holding a batch (its lease)", lambda: watch.zcard(leases), 60, interval=0.05)
        servers[0].stop()
        outage["stopped"] = time.monotonic()
        time.sleep(20)
        servers.append(LocalRedis(tmp_path / "redis", port=port).start())
        outage["restarted"] = time.monotonic()

    try:
        produce(produce_config(url, tiny_model, str(tmp_path / "store"), run="out", dataset=dataset, token_budget=256,
                               max_length=256))
        batches = len(ledger.all_specs(connect(url), "out"))
        caplog.set_level(logging.INFO)
        chaos = threading.Thread(target=stop_and_restart, daemon=True)
        chaos.start()
        monkeypatch.setattr(worker, "Extractor", paced_extractor(1.0))
        run_worker(worker_config(url, tmp_path / "spool", run="out", heartbeat_seconds=1.0))
        chaos.join(timeout=scaled(60))
        assert outage.get("restarted"), "the worker returned before Redis came back"
        run_uploader(upload_config(url, tmp_path / "spool"))
        r = connect(url)
        assert ledger.done_ids(r, "out") == set(ledger.all_specs(r, "out")) and batches > 3
        assert not ledger.failures(r, "out") and not ledger.dead_letters(r, "out")
    finally:
        for server in servers:
            server.stop()
    lost = [m for m in caplog.messages if m.startswith(f"Redis at {url} lost (")]
    back = [m for m in caplog.messages if m.startswith(f"Redis at {url} is back after an outage of ")]
    assert len(lost) == 1 and len(back) == 1, caplog.messages
    assert not [m for m in caplog.messages if "heartbeat failed" in m or "could not connect" in m]


def test_rq_registry_forgets_extract_workers_with_no_hsx_heartbeat(r):
    from rq.worker import Worker

    from hsx import life
    from hsx.life import queues
    from hsx.life.keys import RunKeys

    q = queues.queue(r, queues.extract_queue_name("reg"))
    killed = Worker([q], connection=r, name="gpu-h3-killed")
    alive = Worker([q], connection=r, name="gpu-h3-alive")
    for w in (killed, alive):
        w.register_birth()
    r.set(RunKeys("reg").heartbeat("gpu-h3-alive"), "{}", ex=30)
    assert life.Run(r, "reg").forget_dead_workers() == ["gpu-h3-killed"]
    assert [w.name for w in Worker.all(connection=r, queue=q)] == ["gpu-h3-alive"]
    assert not r.exists(killed.key)


def test_worker_whose_store_vanishes_stops_after_one_batch_without_failing_the_run(tmp_path, r, redis_server,
                                                                                   tiny_model, caplog):
    from gpu_worker.worker import load_runtime, run_worker
    from hsx.life import ledger, queues
    from hsx.runspec.visibility import RunNotVisible
    from producer.produce import produce
    from tests.pipeline import produce_config, worker_config

    store = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store), run="gone"))
    batches = len(queues.queue(r, queues.extract_queue_name("gone")))
    cfg = worker_config(redis_server.url, tmp_path / "spool", run="gone", host="h3")
    rt = load_runtime(cfg)            # the store was there at start ...
    store.rename(tmp_path / "unmounted")  # ... and goes away before the first job
    with pytest.raises(RunNotVisible, match=rf"^this worker cannot see the run's store {store} from host h3 any more"):
        run_worker(cfg, rt)
    assert not ledger.failures(r, "gone") and not ledger.dead_letters(r, "gone")
    assert len(queues.queue(r, queues.extract_queue_name("gone"))) == batches  # the batch was handed back
    assert len([m for m in caplog.messages if "cannot see the run's store" in m]) == 1


def test_why_a_worker_lost_its_store_is_returned_not_kept_on_the_rq_worker(tmp_path):
    """The reason is the answer of one function (the failure handler hands it to the runtime's refusal, which
    serve() raises): nothing is left on the rq worker class for the next worker of the process to find."""
    from types import SimpleNamespace

    from gpu_worker.worker import ExtractWorker, store_lost
    from hsx.store import layout, open_store

    store_dir = tmp_path / "store"
    manifest = store_dir / layout.manifest_key("lost")
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    rt = SimpleNamespace(store=open_store(str(store_dir)), run="lost", cfg=SimpleNamespace(host="h4"))
    missing = FileNotFoundError("inputs/b0000001")
    assert store_lost(rt, "b0000001", FileNotFoundError, missing) is None   # the store is there: the batch's fault
    manifest.unlink()
    assert store_lost(rt, "b0000001", ValueError, ValueError("x")) is None  # not a missing file
    assert store_lost(rt, "b0000001", FileNotFoundError, missing).startswith(
        f"this worker cannot see the run's store {store_dir} from host h4 any more (reading inputs of b0000001")
    assert not hasattr(ExtractWorker, "store_lost")


def test_a_port_that_is_not_redis_is_one_line(capsys, monkeypatch):
    import socket

    listener = socket.create_server(("127.0.0.1", 0))

    def answer_http():  # what an HTTP proxy says to a Redis PING
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer_http, daemon=True).start()
    try:
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        monkeypatch.setenv("HSX_REDIS_URL", url)
        assert main(["status"]) == 2
        line = one_error_line(capsys, "status")
        assert line.startswith(f"hsx status: error: {url} answered, but not as Redis (") and "check the host name" in line
    finally:
        listener.close()


def test_reset_is_refused_while_the_runs_workers_or_uploaders_live(capsys, r, redis_env):
    """A reset under live roles let the worker blame "a Redis restart" and live uploaders write keys back."""
    from hsx.life import heartbeat, leases, ledger
    from hsx.life.keys import RunKeys
    from hsx.life.ledger import BatchSpec
    from tests.manifests import example_manifest

    run = "liverun"
    specs = [BatchSpec(batch_id=f"b{i:07d}", index=i, shard="00000", samples=1, tokens=10, padded=16, padded_len=16,
                       sample_ids=[str(i)]) for i in range(2)]
    ledger.save_plan(r, run, example_manifest(run), specs, {"batches": 2, "samples": 2, "tokens": 20})
    keys = RunKeys(run)
    heartbeat.publish_heartbeat(r, run, "gpu0@hostA", {"host": "hostA", "pid": 1, "batches": 0}, ttl_seconds=60)
    assert main(["reset", "--run", run, "--yes"]) == 2
    line = one_error_line(capsys, "reset")
    assert "run liverun is live: worker gpu0@hostA" in line and "--even-if-live" in line, line
    assert r.exists(keys.manifest)
    r.delete(keys.heartbeat("gpu0@hostA"))                              # the worker gone, an upload still leased
    r.zadd(keys.upload_leases, {specs[1].batch_id: leases.redis_now(r) + 60})
    assert main(["reset", "--run", run, "--yes"]) == 2
    assert "1 batches uploading (b0000001)" in one_error_line(capsys, "reset") and r.exists(keys.manifest)
    assert main(["reset", "--run", run, "--yes", "--even-if-live"]) == 0
    assert not r.keys(f"hsx:{run}:*")
