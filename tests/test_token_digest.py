"""Token columns read by byte range are checked (issue 29 item 8): a batch header carries the SHA-256 of its
token columns (cu_seqlens, input_ids, loss_mask); one token id changed in place in the store is refused by the
peers' token reads (speculators' `tokens` command, SpecForge's in-place vocabulary count), in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hsx.batch import batchfile
from hsx_reader import CorruptBatch, RunDataset
from tests.pipeline import run_pipeline
from tests.waiting import scaled

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
                             capture_output=True, text=True, timeout=scaled(300))
    finally:
        path.write_bytes(original)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "token columns" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "tok" / "token_freq.pt").exists()
    print(json.dumps({"refused": out.stderr.strip()}))


# ---- range reads (RunDataset(fetch="range")): each sample's token rows checked, bytes read ~ the sample's ----
def _store_copy(store: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(store, tmp_path / "store"))


def _token_row(raw: bytes, key: str, token: int) -> int:
    """The row (sample) of the batch object ``raw`` that holds token ``token``."""
    header = batchfile.parse_header(raw[:1 << 16], key, outputs=True)
    cu = batchfile.decode_tensor(torch.frombuffer(bytearray(raw), dtype=torch.uint8), header, "cu_seqlens").tolist()
    return next(b for b in range(len(cu) - 1) if cu[b] <= token < cu[b + 1])


def _older(raw: bytes, key: str, drop: tuple[str, ...]) -> bytes:
    """``raw`` as an older worker wrote it: the header without the metadata keys ``drop`` (same tensors)."""
    import struct

    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    for name in drop:
        header["__metadata__"].pop(name)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + raw[8 + header_len:]


def _set_index_digest(store: Path, key: str, data: bytes) -> None:
    """Record ``data``'s size and SHA-256 for ``key`` in the run's index (an older object, consistently stored)."""
    import hashlib

    index = store / RUN / "index.jsonl"
    lines = [json.loads(line) for line in index.read_text().splitlines() if line.strip()]
    for line in lines:
        if line["key"] == key:
            line.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _refused_by_range(store: Path, path: Path, hit, refs, before: dict, changed: str) -> str:
    """A range read of sample ``hit`` (its ``changed`` column altered in ``path``) is refused in one line naming the
    object and the sample; the batch's other samples (``refs``) still read, every tensor as ``before``. Returns
    the refusal's message."""
    ranged = RunDataset(str(store), RUN, fetch="range")
    with pytest.raises(CorruptBatch) as refused:
        got = ranged[hit.position]
        print(f"\nrange: sample {hit.sample_id!r} served with "
              f"{int((got[changed] != before[hit.position][changed]).sum())} changed {changed} value(s), no error")
    message = str(refused.value)
    assert "\n" not in message and path.name in message and repr(hit.sample_id) in message, message
    for ref in refs:   # the batch's other samples are still read: their own rows are intact
        if ref is not hit:
            sample = ranged[ref.position]
            assert all(torch.equal(sample[name], before[ref.position][name]) for name in before[ref.position]
                       if isinstance(sample[name], torch.Tensor)), ref
    return message


def test_range_reads_refuse_a_changed_token_of_the_sample_read(changed_run, tmp_path):
    """Failing first: one token id changed in place was read silently by RunDataset(fetch="range")."""
    store0, path0, changed = changed_run
    store = _store_copy(store0, tmp_path)
    clean = RunDataset(str(store), RUN, fetch="range")
    key = clean.index.samples[0].key
    path = store / key
    refs = clean.index.by_key()[key]
    row = _token_row(path.read_bytes(), key, 3)             # the sample holding the changed token
    hit = next(ref for ref in refs if ref.row == row)
    before = {ref.position: clean[ref.position] for ref in refs}
    path.write_bytes(changed)

    message = _refused_by_range(store, path, hit, refs, before, "input_ids")
    assert "token" in message, message
    unchecked = RunDataset(str(store), RUN, fetch="range", verify=False)[hit.position]   # the check is what refuses
    assert not torch.equal(unchecked["input_ids"], before[hit.position]["input_ids"])


def test_range_reads_refuse_a_moved_sample_boundary(changed_run, tmp_path):
    """The sample's two cu_seqlens rows are in its digest: a boundary moved in place is refused too."""
    store = _store_copy(changed_run[0], tmp_path)
    ds = RunDataset(str(store), RUN, fetch="range")
    ref = next(r for r in ds.index.samples if r.row == 1)
    path = store / ref.key
    raw = bytearray(path.read_bytes())
    header = batchfile.parse_header(bytes(raw[:1 << 16]), ref.key, outputs=True)
    at = header.tensors["cu_seqlens"].start + 8 * 1            # cu_seqlens[1]: the end of sample 0, start of 1
    raw[at:at + 8] = (int.from_bytes(raw[at:at + 8], "little") + 1).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBatch, match=r"sample .*\(row 1\).*token rows"):
        RunDataset(str(store), RUN, fetch="range")[ref.position]


@pytest.mark.parametrize("age", ["batch token digest only", "no token digest"])
def test_range_reads_of_older_objects_are_checked(changed_run, tmp_path, age):
    """Objects written before the per-sample digests: checked by the batch's token digest (its token columns read
    once), or, older still, read whole and checked against the index's SHA-256. Refused when changed either way."""
    store0, path0, changed = changed_run
    store = _store_copy(store0, tmp_path)
    clean = RunDataset(str(store), RUN, fetch="range")
    key = clean.index.samples[0].key
    refs = clean.index.by_key()[key]
    before = {ref.position: clean[ref.position] for ref in refs}
    drop = (batchfile.SAMPLE_TOKEN_DIGESTS,) + ((batchfile.TOKEN_DIGEST,) if age == "no token digest" else ())
    older = _older((store / key).read_bytes(), key, drop)
    (store / key).write_bytes(older)
    _set_index_digest(store, key, older)
    ranged = RunDataset(str(store), RUN, fetch="range")
    for ref in refs:
        sample = ranged[ref.position]
        for name in ("input_ids", "loss_mask", "hidden_states"):
            assert torch.equal(sample[name], before[ref.position][name]), (ref, name)
    (store / key).write_bytes(_older(changed, key, drop))
    expected = "token columns" if age == "batch token digest only" else "SHA-256 differs from the one the index"
    with pytest.raises(CorruptBatch, match=expected) as refused:
        for ref in refs:   # the whole batch is refused: its digests cover it whole
            RunDataset(str(store), RUN, fetch="range")[ref.position]
    assert "\n" not in str(refused.value) and key.rsplit("/", 1)[-1] in str(refused.value)


def _read_costs(store: Path) -> tuple[list[int], dict[str, int], dict[str, int]]:
    """Reading every sample of the run by range, in random order: (bytes read beyond the sample's own bytes, for
    each sample after the first of its object; bytes read per object; hidden-state bytes per object)."""
    from tests.test_zero_copy import CountingStore

    counting = CountingStore(store)
    ranged, plain = RunDataset(counting, RUN, fetch="range"), RunDataset(str(store), RUN, verify=False)
    over, per_object, hidden = [], {}, {}
    for position in torch.randperm(len(plain), generator=torch.Generator().manual_seed(0)).tolist():
        ref = ranged.index.samples[position]
        before = counting.bytes_read
        sample = ranged[position]
        read = counting.bytes_read - before
        want = plain[position]
        assert all(torch.equal(sample[name], want[name]) for name in ("input_ids", "loss_mask", "hidden_states"))
        if ref.key in per_object:
            over.append(read - sum(t.numel() * t.element_size() for t in want.values() if isinstance(t, torch.Tensor)))
        per_object[ref.key] = per_object.get(ref.key, 0) + read
        hidden[ref.key] = hidden.get(ref.key, 0) + want["hidden_states"].numel() * want["hidden_states"].element_size()
    return over, per_object, hidden


def test_bytes_a_checked_range_read_costs(changed_run, tmp_path):
    """What the check costs in bytes read on the tiny run (printed; docs/training.md has the figures). With
    per-sample digests nothing beyond the sample (+16: its cu_seqlens rows, as before the check) and the header
    probe once per object; with the batch digest only, the batch's token columns once per object instead of
    each sample's token rows."""
    store = changed_run[0]
    over, per_object, hidden = _read_costs(store)
    assert over and set(over) == {16}, over
    sizes = {key: (store / key).stat().st_size for key in per_object}
    probe = {key: min(size, 1 << 16) for key, size in sizes.items()}
    heads = [8 + int.from_bytes((store / key).read_bytes()[:8], "little") for key in per_object]
    older = _store_copy(store, tmp_path)
    for key in per_object:
        (older / key).write_bytes(_older((older / key).read_bytes(), key, (batchfile.SAMPLE_TOKEN_DIGESTS,)))
    old_heads = [8 + int.from_bytes((older / key).read_bytes()[:8], "little") for key in per_object]
    _, old_per_object, _ = _read_costs(older)
    columns = {}
    for key in per_object:
        header = batchfile.parse_header((older / key).read_bytes()[:1 << 16], key, outputs=True)
        columns[key] = sum(header.tensors[name].end - header.tensors[name].start for name in batchfile.TOKEN_COLUMNS)
        assert old_per_object[key] == probe[key] + columns[key] + hidden[key], key   # the columns once, no token rows
    samples = len(RunDataset(str(store), RUN))
    print(f"\nrange reads of {samples} samples in {len(sizes)} objects ({min(sizes.values())}-{max(sizes.values())} "
          f"bytes): per-sample digests: sample bytes + 16 each, header probe {sum(probe.values()) / len(probe):.0f} "
          f"once per object (headers {sum(old_heads) / len(heads):.0f} -> {sum(heads) / len(heads):.0f} bytes); "
          f"batch digest only: + the batch's token columns once per object, {sum(columns.values()) / len(columns):.0f} "
          f"bytes on average = {sum(columns.values()) / samples:.0f} a sample, in place of each sample's token rows")


# ---- hidden-state rows read by range: each sample's checked against its CRC-32 in the header ----
def _flip_hidden_byte(path: Path, key: str, row: int, offset: int = 5) -> None:
    """Flip the low bit of one byte of sample ``row``'s hidden_states rows, in place in the store."""
    raw = bytearray(path.read_bytes())
    header = batchfile.parse_header(bytes(raw[:1 << 16]), key, outputs=True)
    cu = batchfile.decode_tensor(torch.frombuffer(bytearray(raw), dtype=torch.uint8), header, "cu_seqlens").tolist()
    spec = header.tensors["hidden_states"]
    assert cu[row + 1] > cu[row] and offset < spec.row_bytes
    at = spec.start + cu[row] * spec.row_bytes + offset
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_range_reads_refuse_a_changed_hidden_state_byte(changed_run, tmp_path):
    """Failing first: one hidden-state byte changed in place was served silently by RunDataset(fetch="range");
    now refused in one line naming the object, the sample and its row, and the repair. The batch's other samples
    still read; an object without the hidden rows' CRC-32s (written before them) reads as before, unchecked."""
    store = _store_copy(changed_run[0], tmp_path)
    clean = RunDataset(str(store), RUN, fetch="range")
    key = clean.index.samples[0].key
    path = store / key
    refs = clean.index.by_key()[key]
    assert len(refs) > 1
    before = {ref.position: clean[ref.position] for ref in refs}
    original = path.read_bytes()
    hit = refs[len(refs) // 2]
    _flip_hidden_byte(path, key, hit.row)

    message = _refused_by_range(store, path, hit, refs, before, "hidden_states")
    assert f"(row {hit.row})" in message and "hidden" in message, message
    assert f"hsx verify --run {RUN} --repair" in message, message
    unchecked = RunDataset(str(store), RUN, fetch="range", verify=False)[hit.position]   # the check is what refuses
    assert not torch.equal(unchecked["hidden_states"], before[hit.position]["hidden_states"])
    with pytest.raises(CorruptBatch, match="SHA-256 differs from the one the index"):
        RunDataset(str(store), RUN)[hit.position]   # object mode: the whole-object digest, as before

    # an object written before the hidden rows' CRC-32s: read by range as before (tokens checked, hidden not)
    older = _older(original, key, (batchfile.SAMPLE_HIDDEN_DIGESTS,))
    path.write_bytes(older)
    _set_index_digest(store, key, older)
    for ref in refs:
        sample = RunDataset(str(store), RUN, fetch="range")[ref.position]
        assert torch.equal(sample["hidden_states"], before[ref.position]["hidden_states"]), ref
    _flip_hidden_byte(path, key, hit.row)
    served = RunDataset(str(store), RUN, fetch="range")[hit.position]
    assert not torch.equal(served["hidden_states"], before[hit.position]["hidden_states"])


def test_range_reads_of_an_fp8_object_check_its_scales(tmp_path):
    """FP8 (with the final state): a sample's scale rows are in its CRC-32; one changed scale byte is refused,
    the other sample reads, dequantised as before."""
    from hsx.store import LocalStore
    from hsx_reader.objects import fetch_header, fetch_rows

    tensors = {"input_ids": torch.arange(5, dtype=torch.int32), "loss_mask": torch.ones(5, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 3, 5]),
               "hidden_states": torch.full((5, 8), 0.5).to(torch.float8_e4m3fn),
               "hidden_scales": torch.arange(1, 11, dtype=torch.float32).reshape(5, 2),
               "final_hidden_states": torch.full((5, 4), 0.25).to(torch.float8_e4m3fn), "final_scales": torch.ones(5, 1)}
    meta = {"format": batchfile.FORMAT, "run": "fp8run", "sample_ids": json.dumps(["a", "b"]), "dtype": "bfloat16",
            "store_dtype": "float8_e4m3"}
    store = LocalStore(tmp_path)
    path = tmp_path / "b.safetensors"
    path.write_bytes(batchfile.batch_bytes(tensors, meta))
    header = fetch_header(store, path.name)
    hidden = ["hidden_states", "final_hidden_states"]
    before = [fetch_rows(store, header, hidden, lo, hi, row) for row, (lo, hi) in enumerate([(0, 3), (3, 5)])]
    assert before[0]["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(before[0]["hidden_states"][:, :4], torch.full((3, 4), 0.5).to(torch.bfloat16) * torch.tensor(
        [[1.0], [3.0], [5.0]]).to(torch.bfloat16))
    raw = bytearray(path.read_bytes())
    raw[header.tensors["hidden_scales"].start + 3] ^= 0x01     # sample 0's first scale: 1.0 -> 0.25
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBatch, match=r"^\S+b\.safetensors: sample 'a' \(row 0\): its hidden-state rows' CRC-32 "
                                           r"differs.*`hsx verify --run fp8run --repair`"):
        fetch_rows(store, header, hidden, 0, 3, 0)
    assert all(torch.equal(got, before[1][name]) for name, got in fetch_rows(store, header, hidden, 3, 5, 1).items())
    assert not torch.equal(fetch_rows(store, header, hidden, 0, 3)["hidden_states"], before[0]["hidden_states"])
