"""`hsx run`: one command for a run on one host (issue 41, "One command").

Real processes: `hsx run` with its own private redis-server (no HSX_REDIS_URL), the tiny model on the CPU
(`--gpus cpu`), a local store. It completes and verifies with every sample exactly once; a SIGTERM mid-run
stops it cleanly (no lease left, no failure counted, its Redis shut down with the ledger kept in the AOF)
and the same command resumes to the end; on a complete run it says so and exits 0 without starting a role.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from hsx import life
from hsx.batch import read_batch_bytes
from hsx.life.keys import RunKeys
from hsx.redisconn import LocalRedis, connect, reachable
from hsx_tools.demo import sample_dataset
from tests import pacedworker
from tests.deadpid import a_dead_pid
from tests.waiting import scaled, wait_until


def _dataset(tmp_path: Path, rows: int) -> tuple[Path, list[str]]:
    lines = sample_dataset().read_text().splitlines(keepends=True)[:rows]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(lines))
    return path, [json.loads(line)["id"] for line in lines]


def _argv(dataset: Path, model: Path, store: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hsx_cli.main", "run", "--dataset", str(dataset), "--model", str(model),
            "--layers", "dflash:3", "--store", str(store), "--run", "r1", "--gpus", "cpu", "--uploaders-per-gpu", "1",
            "--token-budget", "512", "--max-length", "512", "--dtype", "float32", "--log-every-seconds", "2", *extra]


def _env(**extra: str) -> dict:
    return {**{k: v for k, v in os.environ.items() if k not in ("HSX_REDIS_URL", "REDIS_URL")}, **extra}  # own Redis


def _hsx_run(argv: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, env=_env(**env), timeout=scaled(timeout))


def _stored_sample_ids(store: Path, run: str) -> Counter:
    """Sample ids as the stored batch files' headers hold them, each object read."""
    return Counter(sid for path in sorted((store / run / "batches").rglob("*.safetensors"))
                   for sid in read_batch_bytes(path.read_bytes()).sample_ids)


def _port(store: Path) -> int:
    return int((store / ".hsx-state" / "redis" / "port").read_text())


def _say(out: subprocess.CompletedProcess) -> str:
    return f"rc {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"


@pytest.mark.slow
def test_run_completes_verified_and_a_second_call_says_so(tmp_path, tiny_model):
    dataset, ids = _dataset(tmp_path, 12)
    store = tmp_path / "store"
    argv = _argv(dataset, tiny_model, store, "--verify", "full")
    out = _hsx_run(argv, HSX_BURST="1", HSX_GPU="3")   # a shell's settings for one role: not the children's
    assert out.returncode == 0, _say(out)
    assert "run r1: " in out.stdout and "batches verified, 12 samples" in out.stdout and "; OK" in out.stdout
    assert "run r1 is complete and verified (full)" in out.stdout
    assert f"data in {store / '.hsx-state' / 'redis'}" in out.stdout    # says where its Redis keeps the ledger
    assert _stored_sample_ids(store, "r1") == Counter(ids)              # every sample exactly once
    assert not reachable(f"redis://127.0.0.1:{_port(store)}/0")         # its Redis stopped with it

    t0 = time.monotonic()
    again = _hsx_run(argv)
    seconds = time.monotonic() - t0
    assert again.returncode == 0, _say(again)
    assert "run r1 is already complete: " in again.stdout and "started hsx produce" not in again.stdout
    assert "; OK" in again.stdout
    logs = (store / ".hsx-state" / "logs" / "r1" / "produce.log").read_text()
    assert logs.count("--- ") == 1, logs     # no role started the second time
    argv_lines = [line for path in (store / ".hsx-state" / "logs" / "r1").glob("*.log")
                  for line in path.read_text().splitlines() if line.startswith("--- ")]
    assert len(argv_lines) == 3 and not [line for line in argv_lines if "redis" in line.lower()], argv_lines
    print(f"second call on a complete run: {seconds:.1f} s")
    assert seconds < scaled(20), seconds


@pytest.mark.slow
def test_sigterm_mid_run_then_the_same_command_resumes_every_sample_once(tmp_path, tiny_model):
    dataset, ids = _dataset(tmp_path, 24)
    store = tmp_path / "store"
    argv = _argv(dataset, tiny_model, store)
    log = open(tmp_path / "first.log", "w")
    paced = _env(HSX_TEST_MIN_BATCH_SECONDS="0.5",   # hsx run's worker child: each batch 0.5 s (tests/pacedworker.py)
                 PYTHONPATH=os.pathsep.join(filter(None, [str(pacedworker.SITE), os.environ.get("PYTHONPATH")])))
    first = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=paced)
    try:
        def running() -> None:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]

        wait_until("hsx run's private Redis", lambda: (store / ".hsx-state" / "redis" / "port").exists(), 60,
                   check=running)
        r = connect(f"redis://127.0.0.1:{_port(store)}/0")
        keys = RunKeys("r1")
        total = 0

        def some_done() -> bool:
            nonlocal total
            total = int(r.hget(keys.totals, "batches") or 0)
            running()
            return len(life.Run(r, "r1").done_ids()) >= 2

        wait_until("2 batches done", some_done, 120)
        seen = len(life.Run(r, "r1").done_ids())
        assert seen < total, f"the run ended before the SIGTERM ({seen}/{total}): make batches slower"
        t0 = time.monotonic()
        first.send_signal(signal.SIGTERM)
        rc = first.wait(timeout=scaled(60))
        print(f"hsx run exited {time.monotonic() - t0:.1f} s after SIGTERM, {seen}/{total} batches done then")
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        log.close()
    said = (tmp_path / "first.log").read_text()
    assert rc == 128 + signal.SIGTERM, said[-3000:]
    assert "run the same command again to resume" in said and "unexpected error" not in said, said[-3000:]
    for name in ("produce", "worker-cpu", "upload-0"):
        role_log = (store / ".hsx-state" / "logs" / "r1" / f"{name}.log").read_text()
        assert "unexpected error" not in role_log and "Traceback" not in role_log, role_log[-3000:]
    assert not reachable(f"redis://127.0.0.1:{_port(store)}/0")      # shut down with it

    # Its ledger survived the shutdown (AOF), with nothing in flight: no lease waits to expire, no failure counted.
    with LocalRedis(store / ".hsx-state" / "redis") as kept:
        r = connect(kept.url)
        done_after_stop = len(life.Run(r, "r1").done_ids())
        assert done_after_stop >= seen
        assert not r.zcard(keys.extract_leases) and not r.zcard(keys.upload_leases)
        assert not life.Run(r, "r1").failures() and not life.Run(r, "r1").dead_letters()

    # An uploader of this host killed mid-put (SIGKILL: a second Ctrl-C, an OOM kill) left its temp file: litter,
    # not a gap. Before, the complete run verified "GAPS FOUND" (exit 1) until hsx verify --repair, 10 min later.
    dead_pid = a_dead_pid()
    killed_put = store / "r1" / "batches" / "00000" / f".b9999999.safetensors.tmp-{socket.gethostname()}-{dead_pid}"
    killed_put.parent.mkdir(parents=True, exist_ok=True)
    killed_put.write_bytes(b"half an object")
    out = _hsx_run(argv)
    assert out.returncode == 0, _say(out)
    assert "batches verified, 24 samples" in out.stdout and "; OK" in out.stdout, _say(out)
    assert "removed 1 temp files that killed writers of this host left" in out.stdout and not killed_put.exists()
    assert _stored_sample_ids(store, "r1") == Counter(ids)              # every sample exactly once
    worker_log = (store / ".hsx-state" / "logs" / "r1" / "worker-cpu.log").read_text()
    extracted = [int(n) for n in re.findall(r"^worker \S+: (\d+) batches,", worker_log, re.M)]
    assert len(extracted) == 2 and sum(extracted) <= total + 1, worker_log[-3000:]  # the batch in hand at most twice
    print(f"extracted {extracted} of {total} batches over the two calls; {done_after_stop} done at the stop")


@pytest.mark.parametrize("flags, said", [(("--gpus", "0,0"), "distinct GPU indexes"),
                                         (("--gpus", "cpu", "--run", "../up"), "run name '../up' must be")])
def test_a_wrong_flag_is_one_line_before_anything_starts(tmp_path, flags, said):
    dataset, _ = _dataset(tmp_path, 2)
    out = subprocess.run([sys.executable, "-m", "hsx_cli.main", "run", "--dataset", str(dataset), "--model", "m",
                          "--store", str(tmp_path / "store"), *flags], capture_output=True, text=True,
                         env=_env(), timeout=scaled(60))
    assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "up").exists()   # nothing created, no Redis
