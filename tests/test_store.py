import hashlib
import os

import boto3
import pytest

from hsx.batch import batchfile
from hsx.errors import HsxError
from hsx.store import ObjectNotFound, StoreError, VerifyError, open_store
from hsx.store.quirks import EndpointQuirks
from hsx.store.s3 import S3Settings, S3Store


def _s3(endpoint, bucket, **kw):
    kw.setdefault("quirks", EndpointQuirks(addressing_style="path"))
    return S3Store(S3Settings(bucket=bucket, prefix="pre/fix", endpoint_url=endpoint, region="us-east-1", attempts=2, **kw))


# What each server does (issue 28): moto models AWS; rclone serve s3 answers the whole object's MD5 as a
# multipart ETag and the metadata key as "Sha256".
# SeaweedFS (4.48) forms AWS's composite ETag, and checks x-amz-checksum-crc32 (integrity auto -> crc32 there).
MULTIPART_ETAG = {"moto": "composite", "rclone": "md5", "seaweedfs": "composite"}
CONDITIONAL_WRITES = {"moto": "honoured", "rclone": "ignored", "seaweedfs": "honoured"}  # If-None-Match: * over an object
INTEGRITY = {
    "moto": "integrity md5 (probed: a wrong x-amz-checksum-crc32 was accepted: the server does not check it)",
    "rclone": "integrity md5 (probed: a wrong x-amz-checksum-crc32 was accepted: the server does not check it)",
    "seaweedfs": "integrity crc32 (probed: a wrong x-amz-checksum-crc32 was refused (400 BadDigest), on a part too "
                 "(400 BadDigest), the right ones stored)",
}


@pytest.mark.parametrize("multipart_etag", ["auto", "readback"])
def test_multipart_upload_is_verified(s3_endpoint, s3_endpoint_bucket, tmp_path, request, multipart_etag):
    server = request.node.callspec.params["s3_endpoint"]
    store = _s3(s3_endpoint, s3_endpoint_bucket, multipart_threshold=5 * 2**20, multipart_chunk=5 * 2**20,
                quirks=EndpointQuirks(addressing_style="path", multipart_etag=multipart_etag))
    line = store.checks_line()
    if multipart_etag == "auto":
        assert f"multipart ETag {MULTIPART_ETAG[server]} (probed)" in line, line
    elif server == "seaweedfs":   # crc32 mode: the server's composite CRC32 is the multipart check, not an ETag
        assert "(multipart: the composite crc32(crc32(part)..)-N)" in line, line
    else:
        assert "multipart every multipart object read back" in line, line
    # moto and rclone store a wrong x-amz-checksum-crc32, so integrity auto keeps MD5 there; SeaweedFS refuses it
    assert INTEGRITY[server] in line, line
    if multipart_etag == "auto":
        assert f"conditional writes {CONDITIONAL_WRITES[server]} (hsx relies on none)" in line, line
    data = os.urandom(12 * 2**20 + 123)  # three parts
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    info = store.put_file("run/batches/00000/b1.safetensors", path, len(data), sha)
    assert info.size == len(data) and store.head("run/batches/00000/b1.safetensors").sha256 == sha
    raw = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    head = raw.head_object(Bucket=s3_endpoint_bucket, Key="pre/fix/run/batches/00000/b1.safetensors")
    whole = f'"{hashlib.md5(data).hexdigest()}"'
    assert head["ContentLength"] == len(data) and (head["ETag"].endswith('-3"') if MULTIPART_ETAG[server] == "composite"
                                                   else head["ETag"] == whole)
    assert store.get_bytes("run/batches/00000/b1.safetensors", 10, 20) == data[10:20]
    assert store.get_bytes("run/batches/00000/b1.safetensors", len(data) - 5) == data[-5:]
    assert store.list_keys("run/") == ["run/batches/00000/b1.safetensors"]  # the probe left nothing behind
    assert raw.list_objects_v2(Bucket=s3_endpoint_bucket).get("KeyCount") == 1


def test_a_file_that_differs_from_its_checksum_is_refused(s3_endpoint, s3_endpoint_bucket, tmp_path):
    store = _s3(s3_endpoint, s3_endpoint_bucket)
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    with pytest.raises(VerifyError, match="expected 1000 bytes sha256"):
        store.put_file("k", path, 1000, "0" * 64)
    assert store.head("k") is None


def test_a_missing_object_is_object_not_found_still_a_key_error(s3_endpoint, s3_endpoint_bucket, tmp_path):
    for store in (_s3(s3_endpoint, s3_endpoint_bucket), open_store(str(tmp_path / "local"))):
        for span in ((), (0, 8)):   # the whole object, a range
            with pytest.raises(ObjectNotFound) as missing:
                store.get_bytes("run/nothing", *span)
            assert isinstance(missing.value, KeyError) and missing.value.args == (store.url("run/nothing"),)
            assert isinstance(missing.value, HsxError) and str(missing.value) == f"no object at {store.url('run/nothing')}"


def test_store_down_is_a_clear_error(tmp_path):
    store = S3Store(S3Settings(bucket="nobucket", prefix="", endpoint_url="http://127.0.0.1:9", region="us-east-1",
                               attempts=2))
    with pytest.raises(StoreError, match="put s3://nobucket/k"):
        store.put_bytes("k", b"data")


def test_local_store_round_trip_and_escape(tmp_path):
    store = open_store(str(tmp_path / "root"))
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc" * 100)
    store.put_file("a/b.bin", src, 300, hashlib.sha256(b"abc" * 100).hexdigest())
    assert store.head("a/b.bin").size == 300 and store.get_bytes("a/b.bin", 3, 6) == b"abc"
    with pytest.raises(VerifyError):
        store.put_file("a/c.bin", src, 300, "f" * 64)
    assert store.head("a/c.bin") is None
    with pytest.raises(ValueError, match="escapes"):
        store.put_bytes("../outside", b"x")
    with pytest.raises(ValueError, match="only s3://"):
        open_store("gs://bucket/x")


def test_corrupt_batch_bytes_name_the_key():
    import torch

    data = batchfile.batch_bytes({"input_ids": torch.arange(4, dtype=torch.int32), "loss_mask": torch.ones(4, dtype=torch.uint8),
                               "cu_seqlens": torch.tensor([0, 4])}, {"format": batchfile.FORMAT, "sample_ids": '["a"]'})
    assert batchfile.read_batch_bytes(data).sample_ids == ["a"]
    with pytest.raises(batchfile.BatchFileError, match="run/b.safetensors: corrupt or truncated"):
        batchfile.read_batch_bytes(data[:-5], where="run/b.safetensors")


def test_create_only_writes_hold_where_the_probe_says_they_do(s3_endpoint, s3_endpoint_bucket, request):
    """What the start line says of If-None-Match: * is what the server does: a second create-only write over a key
    is refused (412) where it says honoured, and the first write's bytes stay; where it says ignored, it overwrites."""
    from botocore.exceptions import ClientError

    server = request.node.callspec.params["s3_endpoint"]
    honoured = _s3(s3_endpoint, s3_endpoint_bucket).profile().conditional_writes
    assert honoured is (CONDITIONAL_WRITES[server] == "honoured")
    raw = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    raw.put_object(Bucket=s3_endpoint_bucket, Key="once", Body=b"first", IfNoneMatch="*")
    try:
        raw.put_object(Bucket=s3_endpoint_bucket, Key="once", Body=b"second", IfNoneMatch="*")
        refused = None
    except ClientError as exc:
        refused = exc.response["ResponseMetadata"]["HTTPStatusCode"]
    assert (refused in (409, 412)) is honoured, refused
    kept = raw.get_object(Bucket=s3_endpoint_bucket, Key="once")["Body"].read()
    assert kept == (b"first" if honoured else b"second")
