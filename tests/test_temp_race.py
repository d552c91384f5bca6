"""Two writes of one batch in one worker (a duplicate delivery: `hsx produce` and `retry-failed` both queued it,
or a reaped lease) each get their own temp file; the sweeps still read the writer's worker name from it.

Before, both wrote ``<batch>.safetensors.tmp-<worker name>``: the second open truncated the first's file, the
first's rename moved it away under the second, whose write then failed with FileNotFoundError on "its own"
temp file (seen under load in test_recovery / test_store_faults' corrupt-inputs tests, whose second worker
extracts b0000001 twice).
"""

from __future__ import annotations

import hashlib
import threading
import types

import torch

from gpu_worker import writer as writer_mod
from hsx import life, runspec
from hsx.batch import batchfile


def _writer(tmp_path, name: str = "gpu-testhost-ci") -> writer_mod.SpoolWriter:
    tiers = runspec.SpoolTiers.of(tmp_path / "spool", 2**30)
    return writer_mod.SpoolWriter(life.Run(None, "ci"), types.SimpleNamespace(codec="none"), tiers, "testhost", name,
                                  on_failure=lambda bid, why: None, depth=2, fsync=False)


def test_two_writes_of_one_batch_in_one_worker_do_not_share_a_temp_file(tmp_path, monkeypatch):
    """The first write is held half-way (after its header) until the second one has renamed its file into
    place: the interleaving two writer threads meet under load."""
    real_write_hashed = batchfile._write_hashed
    first_in, second_done = threading.Event(), threading.Event()

    def held_first(fh, digest, chunks):
        if threading.current_thread().name == "first":
            first_in.set()
            assert second_done.wait(10), "the second write never finished"
        return real_write_hashed(fh, digest, chunks)

    monkeypatch.setattr(batchfile, "_write_hashed", held_first)
    spool = _writer(tmp_path)
    tensors = {"hidden_states": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    meta = {"batch_id": "b0000001"}
    results: dict[str, object] = {}

    def write(label: str) -> None:
        try:
            results[label] = spool._write_file("b0000001", 4096 * 4, tensors, meta)
        except Exception as exc:   # the old code's FileNotFoundError, reported by the assert below
            results[label] = exc
        finally:
            if label == "second":
                second_done.set()

    first = threading.Thread(target=write, args=("first",), name="first")
    first.start()
    assert first_in.wait(10)
    second = threading.Thread(target=write, args=("second",), name="second")
    second.start()
    second.join(10)
    first.join(10)
    failed = {label: f"{type(r).__name__}: {r}" for label, r in results.items() if isinstance(r, Exception)}
    assert not failed, failed
    path = tmp_path / "spool" / "ci" / "b0000001.safetensors"
    assert path.stat().st_size == results["first"][2] == results["second"][2]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == results["first"][3] == results["second"][3]  # whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["b0000001.safetensors"]  # no temp file left


def test_the_sweeps_read_the_writer_of_a_per_write_temp_file(tmp_path):
    """The per-write suffix is not part of the writer's name: an old-style temp file still names its writer."""
    run_dir = tmp_path / "ci"
    run_dir.mkdir()
    ours = run_dir / f"b0000001.safetensors.tmp-{runspec.spool_temp_tag('gpu-host.a_1:0')}"
    again = run_dir / f"b0000001.safetensors.tmp-{runspec.spool_temp_tag('gpu-host.a_1:0')}"
    old = run_dir / "b0000002.safetensors.tmp-gpu-old-1"
    for p in (ours, again, old):
        p.write_bytes(b"x")
    assert ours != again
    assert runspec.spool_temp_files(tmp_path, "ci") == {ours: "gpu-host.a_1:0", again: "gpu-host.a_1:0",
                                                         old: "gpu-old-1"}
