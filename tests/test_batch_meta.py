"""A batch header's metadata is encoded in one place (issue 33 item 3): hsx/batch/meta.py's records give the same
bytes as the dicts the writers built by hand before them, read every older header, and refuse a malformed field."""

from __future__ import annotations

import json

import pytest
import torch

from hsx.batch import BatchFileError, BatchMeta, InputsMeta, batchfile, read_meta, sample_rows_crc32
from hsx.batch.dtypes import tensor_bytes
from hsx.life.ledger import BatchSpec
from tests.manifests import example_manifest

SPEC = BatchSpec(batch_id="b0000007", index=7, shard="00001", samples=2, tokens=5, padded=6, padded_len=3,
                 sample_ids=["conv-1", "conv-é"])
MANIFEST = example_manifest(run="metarun", layer_ids=(1, 2), hidden_size=4, store_final=True)


def _tensors(hidden: bool = True) -> dict[str, torch.Tensor]:
    tensors = {"input_ids": torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32),
               "loss_mask": torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 3, 5], dtype=torch.int64)}
    if hidden:
        tensors["hidden_states"] = torch.arange(40, dtype=torch.float32).reshape(5, 8).to(torch.bfloat16)
        tensors["final_hidden_states"] = torch.ones(5, 4, dtype=torch.bfloat16)
    return tensors


def _worker_meta() -> BatchMeta:
    m = MANIFEST
    return BatchMeta(run=m.run, batch_id=SPEC.batch_id, sample_ids=tuple(SPEC.sample_ids), layer_ids=tuple(m.layer_ids),
                     dtype=m.dtype, store_dtype=m.store_dtype, codec=m.codec, model=m.model, hidden_size=m.hidden_size,
                     store_final=m.store_final, incarnation=m.incarnation)


# The dicts gpu_worker/writer.py, producer/produce.py and bench/upload_bench.py built inline before the records
# (commit d67f9a8), kept here as they were: files written by them must keep reading, and new headers are the same.
def _worker_dict_before() -> dict[str, str]:
    m = MANIFEST
    return {"format": batchfile.FORMAT, "run": m.run, "batch_id": SPEC.batch_id,
            "sample_ids": json.dumps(SPEC.sample_ids), "layer_ids": json.dumps(list(m.layer_ids)),
            "dtype": m.dtype, "store_dtype": m.store_dtype, "codec": m.codec, "model": m.model,
            "hidden_size": str(m.hidden_size), "store_final": str(m.store_final).lower(),
            "incarnation": m.incarnation}


def _inputs_dict_before() -> dict[str, str]:
    return {"format": batchfile.INPUT_FORMAT, "run": "metarun", "batch_id": SPEC.batch_id,
            "sample_ids": json.dumps(SPEC.sample_ids), "padded_len": str(SPEC.padded_len)}


def _bench_dict_before() -> dict[str, str]:
    return {"format": batchfile.FORMAT, "run": "metarun", "batch_id": SPEC.batch_id,
            "sample_ids": json.dumps(SPEC.sample_ids), "incarnation": "inc-1"}


CASES = {
    "worker": (_worker_meta, _worker_dict_before, True),
    "producer inputs": (lambda: InputsMeta(run="metarun", batch_id=SPEC.batch_id, sample_ids=tuple(SPEC.sample_ids),
                                           padded_len=SPEC.padded_len), _inputs_dict_before, False),
    "upload bench": (lambda: BatchMeta(run="metarun", batch_id=SPEC.batch_id, sample_ids=tuple(SPEC.sample_ids),
                                       incarnation="inc-1"), _bench_dict_before, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_record_writes_the_bytes_the_hand_built_dict_wrote(case):
    record, before, hidden = CASES[case]
    meta = record()
    assert list(meta.to_metadata().items()) == list(before().items())   # same keys, same order, same strings
    assert batchfile.batch_bytes(_tensors(hidden), meta.to_metadata()) == batchfile.batch_bytes(_tensors(hidden), before())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_written_header_reads_back_as_its_record(case):
    record, _, hidden = CASES[case]
    meta = record()
    data = batchfile.batch_bytes(_tensors(hidden), meta.to_metadata())
    header = batchfile.parse_header(data, "obj", outputs=hidden)
    assert type(header.meta) is type(meta)
    # what the encoder added from the tensors: the token digests; nothing else differs
    added = {"token_sha256": header.meta.token_sha256}
    if hidden:
        added["sample_token_sha256"] = header.meta.sample_token_sha256
        assert len(header.meta.sample_token_sha256) == 32 * len(SPEC.sample_ids)
        assert header.meta.sample_digest(1) == json.loads(header.metadata["sample_token_sha256"])[1]
        added["sample_hidden_crc32"] = header.meta.sample_hidden_crc32
        assert len(header.meta.sample_hidden_crc32) == 4 * len(SPEC.sample_ids)
        tensors = _tensors(hidden)
        rows = {name: tensors[name][3:5] for name in ("hidden_states", "final_hidden_states")}   # sample 1
        assert header.meta.sample_hidden_crc(1) == sample_rows_crc32(rows) != sample_rows_crc32(
            {"hidden_states": rows["hidden_states"]})
        assert f"{header.meta.sample_hidden_crc(1):08x}" == json.loads(header.metadata["sample_hidden_crc32"])[1]
    assert header.meta == type(meta)(**{**meta.__dict__, **added})
    assert read_meta(header.metadata) == header.meta
    assert header.meta.to_metadata() == header.metadata   # re-encoding a parsed header gives its metadata back


def test_headers_of_older_and_newer_files_read():
    """A header without the fields added since (a test's hand-made file, the first workers') reads with None for
    them; a key this hsx does not know (a newer file's) is ignored."""
    bare = batchfile.batch_bytes(_tensors(), {"format": batchfile.FORMAT, "sample_ids": json.dumps(SPEC.sample_ids)})
    meta = batchfile.parse_header(bare, "bare", outputs=True).meta
    assert meta.sample_ids == tuple(SPEC.sample_ids) and meta.run is None and meta.incarnation is None
    assert meta.layer_ids is None and meta.width is None and meta.store_final is None
    newer = {**_worker_dict_before(), "some_later_field": "x"}
    assert BatchMeta.from_metadata(newer) == _worker_meta()


def test_an_older_header_without_the_hidden_crcs_reads_and_keeps_its_bytes():
    """A file written before ``sample_hidden_crc32`` (its header byte for byte as the encoder wrote it then):
    parses with None for it, and its metadata re-encodes to the same bytes; a compressed file has none."""
    data = batchfile.batch_bytes(_tensors(), _worker_meta().to_metadata())
    header_len = int.from_bytes(data[:8], "little")
    raw = json.loads(data[8:8 + header_len])
    assert raw["__metadata__"].pop("sample_hidden_crc32")
    text = json.dumps(raw, separators=(",", ":")).encode()
    head = text + b" " * (-len(text) % 8)
    older = len(head).to_bytes(8, "little") + head + data[8 + header_len:]
    header = batchfile.parse_header(older, "old", outputs=True)
    assert header.meta.sample_hidden_crc32 is None and header.meta.sample_token_sha256 is not None
    assert header.meta.to_metadata() == header.metadata == raw["__metadata__"]
    assert json.dumps({"__metadata__": header.meta.to_metadata(), **{k: v for k, v in raw.items() if k != "__metadata__"}},
                      separators=(",", ":")).encode() == text
    zstd = batchfile.batch_bytes(_tensors(), _worker_meta().to_metadata(), codec="zstd")
    assert batchfile.parse_header(zstd, "z", outputs=True).meta.sample_hidden_crc32 is None


def test_an_fp8_files_hidden_crcs_cover_its_scales():
    """FP8: a sample's CRC-32 covers its rows of hidden_states, hidden_scales, final_hidden_states, final_scales,
    as stored (what a range read of the sample fetches)."""
    tensors = {name: t for name, t in _tensors().items() if "hidden" not in name}
    tensors |= {"hidden_states": torch.full((5, 8), 0.5).to(torch.float8_e4m3fn),
                "hidden_scales": torch.arange(10, dtype=torch.float32).reshape(5, 2),
                "final_hidden_states": torch.full((5, 4), 0.25).to(torch.float8_e4m3fn),
                "final_scales": torch.ones(5, 1)}
    meta = batchfile.parse_header(batchfile.batch_bytes(tensors, _worker_meta().to_metadata()), "fp8", outputs=True).meta
    rows = {name: tensors[name][0:3] for name in ("hidden_states", "hidden_scales", "final_hidden_states", "final_scales")}
    assert meta.sample_hidden_crc(0) == sample_rows_crc32(rows)
    assert meta.sample_hidden_crc(0) != sample_rows_crc32({**rows, "hidden_scales": rows["hidden_scales"] * 2})


MALFORMED = {
    "store_final": "yes",
    "hidden_size": "-4",
    "layer_ids": "[1, true]",
    "sample_token_sha256": json.dumps(["0" * 64]),          # one digest for two samples
    "sample_hidden_crc32": json.dumps(["0" * 8, "0" * 7]),   # a CRC-32 of 7 hex digits
    "padded_len": "0",
}


@pytest.mark.parametrize("field", sorted(MALFORMED))
def test_a_malformed_field_is_a_corrupt_file_naming_it(field):
    inputs = field == "padded_len"
    metadata = {**(_inputs_dict_before() if inputs else _worker_dict_before()), field: MALFORMED[field]}
    head, ordered = batchfile.encode_header(_tensors(not inputs), metadata)
    raw = json.loads(head[8:])
    raw["__metadata__"][field] = MALFORMED[field]          # the encoder would have replaced a digest field
    text = json.dumps(raw, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = len(text).to_bytes(8, "little") + text + b"".join(bytes(tensor_bytes(t)) for t in ordered)
    with pytest.raises(BatchFileError, match=rf"^obj: corrupt.*{field}"):
        batchfile.parse_header(data, "obj", outputs=not inputs)
