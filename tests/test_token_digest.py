"""Token columns read by byte range are checked (issue 29 item 8): a batch header carries the SHA-256 of its
token columns (cu_seqlens, input_ids, loss_mask); one token id changed in place in the store is refused by the
peers' token reads (speculators' `tokens` command, SpecForge's in-place vocabulary count), in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.batch import batchfile
from hsx_reader import CorruptBatch, RunDataset
from tests.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parents[1]
RUN = "tokdigest"


@pytest.fixture(scope="module")
def changed_run(redis_server, tiny_model, tmp_path_factory):
    """A completed run, and the same run with one token id of its first batch object changed in place."""
    from hsx.redisconn import connect

    work = tmp_path_factory.mktemp("tokdigest")
    r = connect(redis_server.url)
    r.flushall()
    run_pipeline(redis_server.url, tiny_model, str(work / "store"), work / "spool", run=RUN)
    r.flushall()
    ds = RunDataset(str(work / "store"), RUN)
    key = ds.index.samples[0].key
    path = work / "store" / key
    raw = bytearray(path.read_bytes())
    header = batchfile.parse_header(bytes(raw[:1 << 16]), key, outputs=True)
    at = header.tensors["input_ids"].start + 4 * 3            # the 4th token of the batch, int32
    before = int.from_bytes(raw[at:at + 4], "little")
    raw[at:at + 4] = ((before + 1) % 500).to_bytes(4, "little")
    return work / "store", path, bytes(raw)


def _peers_samples():
    sys.path.insert(0, str(ROOT / "peers"))
    try:
        from hsx_peers.samples import token_columns
    finally:
        sys.path.remove(str(ROOT / "peers"))
    return token_columns


def test_token_columns_are_checked_against_the_header_digest(changed_run):
    store, path, changed = changed_run
    token_columns = _peers_samples()
    clean = token_columns(RunDataset(str(store), RUN))
    assert len(clean["input_ids"]) == 160
    original = path.read_bytes()
    path.write_bytes(changed)
    try:
        for fetch in ("object", "range"):
            with pytest.raises(CorruptBatch) as refused:
                got = token_columns(RunDataset(str(store), RUN, fetch=fetch))
                changed_ids = sum(a != b for x, y in zip(got["input_ids"], clean["input_ids"], strict=True)
                                  for a, b in zip(x, y, strict=True))
                print(f"\n{fetch}: token_columns returned {changed_ids} changed token id(s), no error")
            message = str(refused.value)
            assert "\n" not in message and "token columns" in message and path.name in message, message
    finally:
        path.write_bytes(original)
    assert "token_sha256" in batchfile.parse_header(original[:1 << 16], path.name, outputs=True).metadata


def test_speculators_tokens_command_refuses_a_changed_token(changed_run, tmp_path):
    from tests.peerenv import peer_env, peer_python

    store, path, changed = changed_run
    original = path.read_bytes()
    path.write_bytes(changed)
    try:
        out = subprocess.run([str(peer_python("speculators")), "-m", "hsx_peers.speculators", "tokens", "--store",
                              str(store), "--run", RUN, "--out", str(tmp_path / "tok")], env=peer_env(tmp_path),
                             capture_output=True, text=True, timeout=300)
    finally:
        path.write_bytes(original)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "token columns" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "tok" / "token_freq.pt").exists()
    print(json.dumps({"refused": out.stderr.strip()}))
