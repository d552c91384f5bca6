"""`hsx status --watch` (hsx_tools.watch): the terminal overview against a real redis-server."""

from __future__ import annotations

import io
import re

from rich.console import Console

from hsx.life import heartbeat, ledger
from hsx.life.ledger import BatchSpec
from hsx_tools.watch import watch
from tests.manifests import example_manifest

SPECS = [BatchSpec(batch_id=f"b{i}", index=i, shard="00000", samples=5, tokens=100, padded=128, padded_len=32,
                   sample_ids=[f"s{i}-{j}" for j in range(5)]) for i in range(4)]


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=160, force_terminal=False, color_system=None), out


def _plan(r):
    ledger.save_plan(r, "w", example_manifest("w"), SPECS, {"batches": 4, "samples": 20, "tokens": 400})


def test_watch_mid_run_shows_bars_workers_hosts_and_dead_letters(r):
    _plan(r)
    for spec in SPECS[:2]:
        ledger.mark_spooled(r, "w", spec.batch_id)
        ledger.mark_done(r, "w", spec, f"w/{spec.batch_id}", 10, "0" * 64, by="test")
    ledger.mark_spooled(r, "w", "b2")
    ledger.record_failure(r, "w", "b3", "disk on fire", max_attempts=1)
    heartbeat.publish_heartbeat(r, "w", "gpu-hostA-0", {"host": "hostA", "name": "NVIDIA H200", "util_pct": 88,
                                                        "current_batch": "b2", "batches": 2}, ttl_seconds=30)
    heartbeat.publish_host(r, "w", "hostA", {"spool_bytes": 2000, "spool_files": 1, "spool_budget_bytes": 4000})
    console, out = _console()
    assert watch(r, "w", interval=0.01, max_iterations=2, console=console) == 0
    text = out.getvalue()
    assert re.search(r"samples\s.*10/20\s+50%", text) and re.search(r"tokens\s.*200/400", text)
    assert re.search(r"batches extracted\s.*3/4\s+75%", text) and re.search(r"uploaded \+ verified\s.*2/4", text)
    assert "run w: in progress" in text and "gpu-hostA-0" in text and "88%" in text and "busy" in text
    assert "hostA" in text and "2.0 KB / 4.0 KB" in text
    assert "1 dead letters" in text and "disk on fire" in text


def test_watch_returns_when_run_complete(r):
    _plan(r)
    for spec in SPECS:
        ledger.mark_done(r, "w", spec, f"w/{spec.batch_id}", 10, "0" * 64, by="test")
    console, out = _console()
    assert watch(r, "w", interval=0.01, max_iterations=None, console=console) == 0  # returns by itself
    assert "run w: COMPLETE" in out.getvalue() and re.search(r"4/4\s+100%", out.getvalue())


def test_watch_stops_cleanly_on_ctrl_c(r, monkeypatch):
    _plan(r)
    calls = []

    def interrupted_sleep(seconds):
        calls.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr("hsx_tools.watch.time.sleep", interrupted_sleep)
    console, out = _console()
    assert watch(r, "w", interval=5.0, console=console) == 0
    assert calls == [5.0] and "0/4" in out.getvalue()


def test_status_watch_cli(r, redis_env, capsys):
    from hsx_cli.main import main

    _plan(r)
    for spec in SPECS:
        ledger.mark_done(r, "w", spec, f"w/{spec.batch_id}", 10, "0" * 64, by="test")
    assert main(["status", "--run", "w", "--watch", "--interval", "0.1"]) == 0
    assert "COMPLETE" in capsys.readouterr().out
