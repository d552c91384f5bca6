"""The memory tier is on by default (issue 22 item 4): its budget is chosen from the tmpfs the host has,
an explicit number wins, 0 turns it off, and the uploader serves it at the same default folder."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid

import pytest

from hsx.life import ledger, queues
from hsx.monitor.progress import run_progress
from hsx.runspec import spool
from hsx_cli import upload as upload_cmd
from hsx_cli import worker as worker_cmd
from hsx_cli.flags import resolve
from hsx_cli.main import build_parser, main
from producer.produce import produce
from tests.pipeline import produce_config

GIB = 2**30


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a real tmpfs of that size (root only), unmounted after the test."""
    mounted = []

    def mount(size: str):
        point = tmp_path / f"tmpfs-{len(mounted)}"
        point.mkdir()
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                             capture_output=True, text=True)
        if out.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=True)


@pytest.fixture(autouse=True)
def default_memory_tier(monkeypatch):
    monkeypatch.delenv("HSX_MEMORY_SPOOL_BUDGET_GB")  # conftest turns it off for the other tests


def _worker_cfg(monkeypatch, redis_url, *args):
    monkeypatch.setenv("HSX_REDIS_URL", redis_url)
    parsed = build_parser().parse_args(["worker", "--device", "cpu", *args])
    return worker_cmd.config(resolve(worker_cmd.FLAGS, parsed))


def test_auto_takes_half_of_a_real_tmpfs_and_leaves_a_small_one_off(tmpfs, tmp_path):
    big, small = tmpfs("4g"), tmpfs("1g")
    budget, why = spool.auto_memory_budget(big / "hsx")        # the folder is not there yet: measured at the mount
    assert budget == 2 * GIB and "auto: 0.5 of the 4.00 GiB free" in why
    assert spool.auto_memory_budget(big / "hsx", cap=GIB) == (GIB, "auto: 0.5 of the 4.00 GiB free on the tmpfs "
                                                                    f"of {big / 'hsx'}, at most 1 GiB")
    budget, why = spool.auto_memory_budget(small)
    assert budget == 0 and "under 1 GiB: memory tier off" in why
    budget, why = spool.auto_memory_budget(tmp_path / "disk")  # not a tmpfs
    assert budget == 0 and "is not on a tmpfs" in why and "memory tier off" in why


def test_worker_flag_defaults_to_auto_and_an_explicit_value_wins(tmpfs, monkeypatch):
    mem = tmpfs("4g")
    auto = _worker_cfg(monkeypatch, "redis://127.0.0.1:1/0", "--memory-spool-dir", str(mem))
    assert auto.memory_spool_budget_bytes == 2 * GIB and auto.memory_spool_why.startswith("auto:")
    assert [t.name for t in auto.tiers.tiers] == ["memory", "disk"]
    given = _worker_cfg(monkeypatch, "redis://127.0.0.1:1/0", "--memory-spool-dir", str(mem),
                        "--memory-spool-budget-gb", "0.25")
    assert given.memory_spool_budget_bytes == GIB // 4
    off = _worker_cfg(monkeypatch, "redis://127.0.0.1:1/0", "--memory-spool-dir", str(mem),
                      "--memory-spool-budget-gb", "0")
    assert off.memory_spool_budget_bytes == 0 and [t.name for t in off.tiers.tiers] == ["disk"]
    monkeypatch.setenv("HSX_MEMORY_SPOOL_BUDGET_GB", "auto")
    assert _worker_cfg(monkeypatch, "redis://127.0.0.1:1/0", "--memory-spool-dir",
                       str(mem)).memory_spool_budget_bytes == 2 * GIB


def test_default_flags_put_batches_through_the_memory_tier(r, redis_server, tiny_model, tmp_path, monkeypatch,
                                                           caplog):
    """Worker and uploader with no spool flag but --spool-dir: every batch file goes through the default
    memory tier (/dev/shm/hsx-<uid>-<Redis tag>) and the uploader empties it."""
    default_dir = spool.default_memory_dir(redis_server.url)
    budget, why = spool.auto_memory_budget(default_dir)
    if not budget:
        pytest.skip(why)
    run, disk = f"auto-{uuid.uuid4().hex[:8]}", tmp_path / "disk"
    mem_run = os.path.join(default_dir, run)
    monkeypatch.setenv("HSX_REDIS_URL", redis_server.url)
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run=run))
    caplog.set_level(logging.INFO)
    try:
        assert main(["worker", "--device", "cpu", "--run", run, "--spool-dir", str(disk), "--host", "testhost",
                     "--burst"]) == 0
        batches = ledger.run_totals(r, run)["batches"]
        q = queues.queue(r, queues.upload_queue_name("testhost"))
        assert [q.fetch_job(j).kwargs["tier"] for j in q.get_job_ids()] == ["memory"] * batches
        assert len(spool.spool_files(default_dir, run)) == batches
        assert not spool.spool_files(disk, run)
        line = next(rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("spool: "))
        assert f"memory {default_dir}" in line and "(memory tier: auto: 0.5 of the" in line
        assert upload_cmd.config(resolve(upload_cmd.FLAGS, build_parser().parse_args(
            ["upload", "--spool-dir", str(disk)]))).memory_spool_dir == worker_cmd.config(resolve(
                worker_cmd.FLAGS, build_parser().parse_args(["worker", "--device", "cpu"]))).memory_spool_dir
        assert main(["upload", "--spool-dir", str(disk), "--host", "testhost", "--burst"]) == 0
        assert run_progress(r, run)["complete"]
        assert not spool.spool_files(default_dir, run)
        assert not default_dir.exists()  # issue 41 item 10: an empty /dev/shm/hsx-<uid>-<tag>/<run> stayed behind
    finally:
        shutil.rmtree(mem_run, ignore_errors=True)


def test_a_clean_stop_removes_only_empty_folders_and_the_default_only(tmp_path):
    """Issue 41 item 10: what remove_empty_folders leaves: a folder holding anything, and a folder a person named."""
    named = tmp_path / "named"
    for folder in ("run-a", "run-b", "run-c"):
        (named / folder).mkdir(parents=True)
    (named / "run-b" / "b0000001.safetensors.tmp-worker-2").write_bytes(b"another role's write")
    (named / "notes.txt").write_text("not hsx's")
    assert sorted(p.name for p in spool.remove_empty_spool_folders(named, itself=False)) == ["run-a", "run-c"]
    assert sorted(p.name for p in named.iterdir()) == ["notes.txt", "run-b"]
    default = tmp_path / "hsx-0-abcdef12"
    (default / "run-a").mkdir(parents=True)
    assert spool.remove_empty_spool_folders(default, itself=True) == [default / "run-a", default]
    assert not default.exists() and spool.remove_empty_spool_folders(default, itself=True) == []   # gone: nothing to do
    (named / "run-b" / "b0000001.safetensors.tmp-worker-2").unlink()
    (named / "notes.txt").unlink()
    assert spool.remove_empty_spool_folders(named, itself=False) == [named / "run-b"] and named.is_dir()
