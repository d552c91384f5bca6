"""The memory spool's default folder is one a user and Redis server (issue 31 item 13), and files an older hsx
left in the old shared default /dev/shm/hsx are still found and uploaded."""

from __future__ import annotations

import os
from pathlib import Path

from hsx import runspec
from hsx.runspec import spool
from hsx.runspec.config import UploadConfig
from hsx_cli import upload as upload_cmd
from hsx_cli import worker as worker_cmd
from hsx_cli.flags import resolve
from hsx_cli.main import build_parser
from uploader.runtime import UploaderRuntime


def _memory_dir(command, monkeypatch, redis_url: str, *argv: str) -> Path:
    monkeypatch.setenv("HSX_REDIS_URL", redis_url)
    monkeypatch.delenv("HSX_MEMORY_SPOOL_DIR", raising=False)
    args = build_parser().parse_args([command.COMMAND.name, *argv])
    return command.config(resolve(command.FLAGS, args)).memory_spool_dir


def test_two_redis_servers_or_two_users_never_share_the_default_memory_folder(monkeypatch):
    real = _memory_dir(worker_cmd, monkeypatch, "redis://127.0.0.1:6379/0", "--device", "cpu")
    test = _memory_dir(worker_cmd, monkeypatch, "redis://127.0.0.1:40123/0", "--device", "cpu")
    assert real != test and real.parent == test.parent == Path("/dev/shm")
    assert real.name.startswith(f"hsx-{os.getuid()}-")
    # Worker and uploader of one deployment agree, however the loopback address is spelled.
    assert _memory_dir(upload_cmd, monkeypatch, "redis://localhost:6379") == real
    assert _memory_dir(upload_cmd, monkeypatch, "redis://:secret@127.0.0.1:6379/0") == real  # no password in it
    assert _memory_dir(upload_cmd, monkeypatch, "redis://127.0.0.1:6379/1") != real  # another database
    assert "secret" not in str(real)
    monkeypatch.setattr(os, "getuid", lambda: 4321)  # another user on the same host and Redis
    assert _memory_dir(worker_cmd, monkeypatch, "redis://127.0.0.1:6379/0", "--device", "cpu").name.startswith(
        "hsx-4321-")
    # Given by flag, it is the flag's (compose gives /dev/shm/hsx to every container of the box).
    assert _memory_dir(upload_cmd, monkeypatch, "redis://127.0.0.1:6379/0", "--memory-spool-dir",
                       "/dev/shm/hsx") == Path("/dev/shm/hsx")


def test_files_left_in_the_old_shared_default_are_adopted(tmp_path):
    legacy, new = tmp_path / "shm-hsx", tmp_path / "new"
    (legacy / "run1").mkdir(parents=True)
    (legacy / "run1" / "b0000001.safetensors").write_bytes(b"batch 1")
    (legacy / "run1" / "b0000002.safetensors.tmp-gpu-0").write_bytes(b"half written")
    (legacy / "run2").mkdir()
    (legacy / "run2" / "b0000001.safetensors").write_bytes(b"another run")
    moved = spool.adopt_legacy_spool("run1", new, legacy=legacy)
    assert moved == [new / "run1" / "b0000001.safetensors"] and moved[0].read_bytes() == b"batch 1"
    assert not (legacy / "run1" / "b0000001.safetensors").exists()
    assert (legacy / "run1" / "b0000002.safetensors.tmp-gpu-0").exists()  # never finished: not a batch
    assert (legacy / "run2" / "b0000001.safetensors").exists()  # another run's: its worker adopts it
    assert spool.adopt_legacy_spool("run1", legacy, legacy=legacy) == []  # the flag named the old folder itself


def test_an_uploader_takes_a_job_an_older_hsx_queued_for_the_old_default(tmp_path, monkeypatch, r, redis_server):
    legacy = tmp_path / "shm-hsx"
    for where in (spool, runspec):  # the module, and the face the roles read it from
        monkeypatch.setattr(where, "LEGACY_MEMORY_DIR", legacy)
    (legacy / "run1").mkdir(parents=True)
    (legacy / "run1" / "b0000001.safetensors").write_bytes(b"batch 1")
    default = spool.default_memory_dir(redis_server.url, shm=tmp_path)
    for where in (spool, runspec):  # the module, and the face the roles read it from
        monkeypatch.setattr(where, "default_memory_dir", lambda url: default)
    cfg = UploadConfig(redis_url=redis_server.url, spool_dir=tmp_path / "disk", host="h", burst=True,
                       worker_name="upload-h", heartbeat_seconds=1.0, memory_spool_dir=default)
    rt = UploaderRuntime(cfg, r)
    local = rt.spool_file("run1", "b0000001", str(legacy / "run1" / "b0000001.safetensors"), "memory")
    assert local == default / "run1" / "b0000001.safetensors" and local.read_bytes() == b"batch 1"


def test_a_worker_with_the_default_folder_adopts_its_runs_old_files_and_one_given_a_folder_does_not(tmp_path,
                                                                                                    monkeypatch):
    from types import SimpleNamespace

    from gpu_worker.spoolrecovery import SpoolRecovery

    legacy = tmp_path / "shm-hsx"
    for where in (spool, runspec):  # the module, and the face the roles read it from
        monkeypatch.setattr(where, "LEGACY_MEMORY_DIR", legacy)
    (legacy / "run1").mkdir(parents=True)
    (legacy / "run1" / "b0000001.safetensors").write_bytes(b"batch 1")
    url = "redis://127.0.0.1:6379/0"
    default = spool.default_memory_dir(url, shm=tmp_path)
    for where in (spool, runspec):  # the module, and the face the roles read it from
        monkeypatch.setattr(where, "default_memory_dir", lambda redis_url: default)

    def worker(memory_dir):  # what adopt_legacy reads of a worker's config (no Redis, no model needed)
        tiers = spool.SpoolTiers.of(tmp_path / "disk", 2**30, memory_dir, 2**30)
        return SpoolRecovery(None, SimpleNamespace(memory_spool_dir=memory_dir, redis_url=url, run="run1",
                                                   worker_name="gpu-1"), tiers)

    assert worker(tmp_path / "chosen").adopt_legacy() == set()
    assert (legacy / "run1" / "b0000001.safetensors").exists()
    assert worker(default).adopt_legacy() == {"b0000001"}
    assert spool.spool_files(default, "run1") == [default / "run1" / "b0000001.safetensors"]
