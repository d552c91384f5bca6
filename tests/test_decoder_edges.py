"""Issue 23 item 13: crafted batch objects, the local reader's path check, a renamed dataset, an unknown run.

Every crafted object here is one a read without the digest check would meet (the reader without an index,
`fetch="range"`, a worker's inputs before its digest is known): each must give the one CorruptBatch /
BatchFileError naming the object and what is wrong, and nothing may be allocated from a size the header
only claims.
"""

import json
import shutil
import struct
import tracemalloc

import pytest
import torch

from hsx.batch import batchfile
from hsx.batch.batchfile import BatchFileError
from hsx.batch.dtypes import tensor_bytes
from hsx.life import ledger
from hsx.life.keys import RunKeys
from hsx.runspec.manifest import ManifestMismatch
from hsx.store import LocalStore
from hsx_reader.objects import CorruptBatch, decode, fetch_object
from hsx_reader.run import ReaderError
from hsx_tools.demo import sample_dataset
from producer.produce import produce
from tests.manifests import example_manifest
from tests.pipeline import produce_config

N = 4
MANIFEST = example_manifest(layer_ids=(0, 1), hidden_size=4, dtype="bfloat16")
METADATA = {"format": batchfile.FORMAT, "run": "r", "batch_id": "b0000000", "sample_ids": json.dumps(["s0"]),
            "layer_ids": "[0, 1]", "hidden_size": "4", "dtype": "bfloat16"}


def _tensors(**changed):
    tensors = {"hidden_states": torch.ones(N, 8, dtype=torch.bfloat16), "input_ids": torch.zeros(N, dtype=torch.int32),
               "loss_mask": torch.ones(N, dtype=torch.uint8), "cu_seqlens": torch.tensor([0, N], dtype=torch.int64)}
    tensors.update(changed)
    return tensors


def _object(tensors=None, edit=None, tail: bytes = b"") -> bytes:
    """A batch file whose JSON header ``edit(header)`` may change after encoding; ``tail`` appended to the data."""
    head, ordered = batchfile.encode_header(tensors or _tensors(), METADATA)
    header = json.loads(head[8:])
    if edit:
        edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(bytes(tensor_bytes(t)) for t in ordered) + tail


def _compressed(shape, planes, frame: bytes) -> bytes:
    """hidden_states as a zstd plane table declaring ``shape``."""
    def edit(header):
        end = max(t["data_offsets"][1] for name, t in header.items() if name != "__metadata__")
        header["hidden_states.zstd"] = {"dtype": "U8", "shape": [len(frame)], "data_offsets": [end, end + len(frame)]}
        header["__metadata__"]["encoding"] = json.dumps(
            {"hidden_states": {"codec": "zstd", "dtype": "BF16", "shape": shape, "planes": planes(len(frame))}})

    tensors = _tensors()
    del tensors["hidden_states"]
    return _object(tensors, edit, tail=frame)


def _set(name, **fields):
    return lambda header: header[name].update(fields)


def _meta(**fields):
    return lambda header: header["__metadata__"].update(fields)


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


CRAFTED = {
    # accepted before (wrong dtypes and ranks reached the trainer)
    "input_ids as float32": (_object(_tensors(input_ids=torch.zeros(N, dtype=torch.float32))), "input_ids"),
    "loss_mask as int64": (_object(_tensors(loss_mask=torch.ones(N, dtype=torch.int64))), "loss_mask"),
    "cu_seqlens as float32": (_object(_tensors(cu_seqlens=torch.tensor([0.0, N]))), "cu_seqlens"),
    "input_ids of rank 2": (_object(_tensors(input_ids=torch.zeros(N, 1, dtype=torch.int32))), "input_ids"),
    "sample ids not strings": (_object(edit=_meta(sample_ids=json.dumps([{"a": 1}]))), "sample_ids"),
    "overlapping tensors": (_object(edit=_set("input_ids", data_offsets=[0, 16])), "overlap"),
    # ValueError from the reader's manifest check (dtype_name), not CorruptBatch
    "hidden states as int32": (_object(_tensors(hidden_states=torch.zeros(N, 8, dtype=torch.int32))), "hidden_states"),
    # RuntimeError from torch's reshape
    "negative shape": (_object(edit=lambda h: h["input_ids"].update(shape=[-4], data_offsets=[16, 0])), "input_ids"),
    # json.JSONDecodeError from the reader's manifest check
    "layer_ids not JSON": (_object(edit=_meta(layer_ids="{bad")), "layer_ids"),
    # TypeError from the codec
    "plane table an int": (_compressed([N, 8], lambda n: 5, _zstd(bytes(64))), "plane table"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_every_malformed_batch_is_the_one_corrupt_batch_error(case):
    data, named = CRAFTED[case]
    with pytest.raises(BatchFileError, match=rf"^obj\.safetensors: corrupt.*{named}"):
        batchfile.read_batch_bytes(data, "obj.safetensors")
    with pytest.raises(CorruptBatch, match=rf"^obj\.safetensors: corrupt.*{named}"):
        decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), "obj.safetensors", MANIFEST)


def test_a_tiny_object_is_refused_before_its_declared_size_is_allocated():
    bomb = _compressed([2 * N, 8 * 2**20], lambda n: [["zstd", n]], _zstd(bytes(128 * 2**20)))  # 128 MiB of zeros
    assert len(bomb) < 8 * 2**10
    tracemalloc.start()
    try:
        with pytest.raises(BatchFileError, match=r"hidden_states.*\[8, 8388608\].*4 tokens"):
            batchfile.read_batch_bytes(bomb, "bomb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak} bytes allocated for a {len(bomb)}-byte object"
    # The right token count but a width the header's layer_ids x hidden_size do not give: refused as well.
    wide = _compressed([N, 32 * 2**20], lambda n: [["zstd", n]], _zstd(bytes(256 * 2**20)))
    with pytest.raises(BatchFileError, match=r"layer_ids x hidden_size say \[4, 8\]"):
        batchfile.read_batch_bytes(wide, "wide")


def test_a_good_object_still_decodes():
    contents = batchfile.read_batch_bytes(_object(), "good")
    assert contents.hidden_states.shape == (N, 8) and contents.sample_ids == ["s0"]


def test_local_reader_keeps_to_the_store_root(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "outside.safetensors").write_bytes(_object())
    store = LocalStore(tmp_path / "store")
    with pytest.raises(ReaderError, match="escapes the store root"):
        fetch_object(store, "../outside.safetensors")
    (tmp_path / "store" / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ReaderError, match="escapes the store root"):
        fetch_object(store, "link.safetensors")


def test_the_same_dataset_under_another_name_is_the_same_run(r, redis_server, tiny_model, tmp_path):
    renamed = tmp_path / "renamed.jsonl"
    shutil.copyfile(sample_dataset(), renamed)
    cfg = produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rn", enqueue=False)
    first = produce(cfg)
    again = produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rn", enqueue=False,
                                   dataset=renamed))
    assert again.batches == first.batches and again.manifest.dataset_fingerprint == first.manifest.dataset_fingerprint
    # A run planned before (its fingerprint covered the file name) still resumes under that name ...
    import hashlib

    named = hashlib.sha256(sample_dataset().name.encode() + sample_dataset().read_bytes()).hexdigest()
    manifest = {**ledger.get_manifest(r, "rn").to_dict(), "dataset_fingerprint": named}
    r.set(RunKeys("rn").manifest, json.dumps(manifest, sort_keys=True))  # as the old producer left it
    assert produce(cfg).manifest.dataset_fingerprint == named
    # ... and other bytes are still another dataset.
    renamed.write_text(sample_dataset().read_text().replace("a", "b", 1))
    with pytest.raises(ManifestMismatch, match="dataset_fingerprint"):
        produce(produce_config(redis_server.url, tiny_model, str(tmp_path / "store"), run="rn", enqueue=False,
                               dataset=renamed))


def test_retry_failed_of_an_unknown_run_exits_2(redis_env):
    from tests.test_cli import hsx

    out = hsx("retry-failed", "--run", "nosuchrun")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and "nosuchrun" in out.stderr and "not planned" in out.stderr


def test_compressed_hidden_states_need_their_declared_width():
    data = _compressed([N, 8], lambda n: [["zstd", n]], _zstd(bytes(64)))
    assert batchfile.read_batch_bytes(data, "ok").hidden_states.shape == (N, 8)
    head_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + head_len])
    del header["__metadata__"]["layer_ids"], header["__metadata__"]["hidden_size"]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with pytest.raises(BatchFileError, match="compressed hidden states without layer_ids and hidden_size"):
        batchfile.read_batch_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + head_len:], "bare")
