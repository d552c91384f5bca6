"""Small integrity holes: verify's counts and temp files, deeply nested batch headers."""

import json
import os
import socket
import struct

import pytest

from hsx.batch import batchfile
from hsx.life import ledger
from hsx.store import layout, open_store
from hsx_tools.demo import sample_dataset
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.deadpid import a_dead_pid
from tests.pipeline import produce_config


def _nested_header_object() -> bytes:
    header = ("[" * 100_000 + "]" * 100_000).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def test_deeply_nested_header_is_a_corrupt_batch_not_a_crash():
    from hsx_reader.objects import CorruptBatch, parse_header

    data = _nested_header_object()
    with pytest.raises(CorruptBatch, match="corrupt"):
        parse_header(data, "k")
    with pytest.raises(batchfile.BatchFileError, match="corrupt"):
        batchfile.parse_header(data, "k")
    with pytest.raises(batchfile.BatchFileError):
        batchfile.read_batch_bytes(data, "k")


def test_verify_counts_every_missing_sample(r, redis_server, tiny_model, tmp_path):
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines()]
    dataset = tmp_path / "big.jsonl"
    with open(dataset, "w") as fh:
        for i in range(1500):
            fh.write(json.dumps({**rows[i % len(rows)], "id": f"s{i:05d}"}) + "\n")
    produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="mc", dataset=dataset,
                           enqueue=False, max_length=64, overlong="truncate", token_budget=4096, max_batch_rows=512,
                           max_reject_share=1.0))
    planned = ledger.run_totals(r, "mc")["samples"]
    assert planned > 1000
    report = verify_run(r, open_store(str(tmp_path / "store")), "mc")
    assert len(report.missing_samples) == planned
    assert any(line.strip().startswith(f"{planned} planned sample ids are missing") for line in report.lines())


def test_verify_reports_and_repair_removes_store_temp_files(r, redis_server, tiny_model, tmp_path):
    store_dir = tmp_path / "store"
    produce(produce_config(redis_server.url, tiny_model, str(store_dir), run="tf", enqueue=False))
    shard = store_dir / "tf" / "batches" / "00000"
    shard.mkdir(parents=True)
    host = socket.gethostname()
    stale = shard / ".b0000000.safetensors.tmp-4242"  # a producer/uploader killed mid-put (an older hsx's name)
    fresh = shard / ".b0000001.safetensors.tmp-4343"  # a put in progress right now, its writer not known
    killed = shard / f".b0000002.safetensors.tmp-{host}-{a_dead_pid()}"   # a writer of this host, gone: at once
    live = shard / f".b0000003.safetensors.tmp-{host}-{os.getpid()}"      # this host's, running: kept
    elsewhere = shard / f".b0000004.safetensors.tmp-otherhost-{a_dead_pid()}"   # another host's pid: not known
    for path in (stale, fresh, killed, live, elsewhere):
        path.write_bytes(b"partial")
    os.utime(stale, (1e9, 1e9))
    store = open_store(str(store_dir))
    report = verify_run(r, store, "tf")
    assert not report.ok and sorted(report.temp_files) == sorted(map(str, (stale, fresh, killed, live, elsewhere)))
    assert any("temp files of killed writers" in line for line in report.lines())
    assert killed.exists()   # verify alone reads only
    repaired = verify_run(r, store, "tf", repair=True)
    assert sorted(repaired.removed_temp_files) == sorted([str(stale), str(killed)])
    assert not stale.exists() and not killed.exists() and fresh.exists() and live.exists() and elsewhere.exists()
    assert layout.batch_key("tf", "00000", "b0000000") not in store.list_keys("tf/")
