"""hsx against a real S3 server beside moto (issue 28): rclone serve s3 (tests/rclone.py) and moto, through
tests/lyingstore.py's proxy where a fault is needed.

- corruption in transit (a byte flipped, a body cut) is caught before the spool file may be deleted, on
  both servers and on one that checks no checksum (moto with Content-MD5 stripped), single-part and
  multipart; the table goes to test-artifacts/corruption-in-transit.md (docs/reliability.md keeps it);
- a server that rejects boto3's default checksums works with the default settings, and with the checksums
  forced on the error is one line naming the setting;
- a whole run (produce, worker, uploader through a corrupting proxy, verify, the follower and the range
  reader, verify --repair of an object corrupted at rest) completes on each server, every batch multipart.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys

import boto3
import pytest
import torch

from hsx.life import ledger
from hsx.monitor.progress import run_progress
from hsx.runspec import spool
from hsx.runspec.config import StoreSettings
from hsx.store import PermanentStoreError, StoreError, layout
from hsx.store.quirks import EndpointQuirks
from hsx.store.s3 import S3Settings, S3Store
from hsx_reader import RunDataset, RunFollower
from hsx_tools.demo import sample_dataset
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.lyingstore import LyingStoreProxy
from tests.pipeline import produce_config, upload_config, worker_config

SERVERS = {"moto": "s3_server", "rclone": "rclone_server", "moto, no Content-MD5": "s3_server",
           "moto + AWS's CRC32 check (integrity auto -> crc32)": "s3_server",
           "seaweedfs (checks CRC32 itself: integrity auto -> crc32)": "seaweedfs_server"}
# moto 5.2.5 and rclone 1.75 store any x-amz-checksum-crc32 unchecked (so hsx keeps MD5 there); AWS, MinIO and
# SeaweedFS 4.48 refuse a wrong one. For moto the proxy does that check (tests/lyingstore.py check_crc32) to stand
# for such a server; SeaweedFS (tests/seaweedfs.py) is one.
CRC32_SERVERS = {"moto + AWS's CRC32 check (integrity auto -> crc32)", "seaweedfs (checks CRC32 itself: integrity auto -> crc32)"}
SIZES = {"single-part": 100_000, "multipart": 6 * 2**20 + 321}  # bytes; multipart: two parts of <= 5 MiB
TABLE: dict[tuple[str, str, str], str] = {}


@pytest.fixture
def proxy_to(request):
    proxies = []

    def make(upstream: str) -> LyingStoreProxy:
        proxies.append(LyingStoreProxy(upstream, lies=0))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.stop()


def _store(endpoint: str, bucket: str, **quirks) -> S3Store:
    return S3Store(S3Settings(bucket=bucket, prefix="p", endpoint_url=endpoint, region="us-east-1", attempts=1,
                              multipart_threshold=5 * 2**20, multipart_chunk=5 * 2**20,
                              quirks=EndpointQuirks(addressing_style="path", **quirks)))


def _caught_by(error: str, crc32: bool = False) -> str:
    """Which check refused an upload; ``crc32``: the upload carried x-amz-checksum-crc32 and no Content-MD5 (so a
    BadDigest answers the CRC32, whatever the server's words: SeaweedFS says "Content-Md5")."""
    for words, check in (("The CRC32 you specified", "the server: x-amz-checksum-crc32 (BadDigest)"),
                         ("BadDigest", f"the server: {'x-amz-checksum-crc32' if crc32 else 'Content-MD5'} (BadDigest)"),
                         ("XAmzContentSHA256Mismatch", "the server: SigV4 payload SHA-256"),
                         ("EntityTooSmall", "the server: a part below 5 MiB (EntityTooSmall)")):
        if words in error:
            return check
    found = [check for words, check in (("read back", "read-back SHA-256"), ("size ", "size"), ("ETag", "ETag"),
                                           ("ChecksumCRC32", "ChecksumCRC32"))
             if words in error]
    return f"hsx: {' + '.join(found)} (HEAD)" if found else f"other: {error[:80]}"


def _new_bucket(endpoint: str) -> str:
    import uuid

    name = f"hsx-c-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.mark.parametrize("corruption", ["flip", "truncate"])
@pytest.mark.parametrize("kind", list(SIZES))
@pytest.mark.parametrize("server", list(SERVERS))
def test_corruption_in_transit_is_caught_before_the_spool_file_is_deleted(server, kind, corruption, request,
                                                                          proxy_to, tmp_path):
    upstream = request.getfixturevalue(SERVERS[server])
    proxy = proxy_to(upstream)
    proxy.strip_md5 = server.endswith("no Content-MD5")
    proxy.check_crc32 = server.startswith("moto + ")
    crc32 = server in CRC32_SERVERS
    store = _store(proxy.url, _new_bucket(upstream))
    # the probe's upload passes unharmed; only the batch's bodies are corrupted
    assert f"integrity {'crc32' if crc32 else 'md5'} (probed: " in store.checks_line()
    data = os.urandom(SIZES[kind])
    spool_file = tmp_path / "b0000000.safetensors"
    spool_file.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    # the last part of a multipart upload (parts go in parallel: "the first body" would be either)
    proxy.corrupt, proxy.corrupt_left, proxy.bad_digests = corruption, 1, 0
    proxy.corrupt_match = "partNumber=2" if kind == "multipart" else ""
    with pytest.raises(StoreError) as caught:   # the uploader deletes its spool file only after put_file returns
        store.put_file("run/batches/00000/b0000000.safetensors", spool_file, len(data), sha)
    assert proxy.corrupted == 1 and spool_file.read_bytes() == data
    TABLE[server, kind, corruption] = _caught_by(str(caught.value), crc32)
    assert not TABLE[server, kind, corruption].startswith("other"), caught.value
    if server.startswith("seaweedfs"):   # a server that checks CRC32 refuses the corrupted request itself
        assert TABLE[server, kind, corruption] == "the server: x-amz-checksum-crc32 (BadDigest)" and proxy.bad_digests == 1
    # the next try (the uploader's retry) lands the right bytes
    store.put_file("run/batches/00000/b0000000.safetensors", spool_file, len(data), sha)
    store.read_back("run/batches/00000/b0000000.safetensors", len(data), sha)


def test_zz_corruption_table(artifacts):
    """Writes the table of the cases above (run in the same session); skipped when they did not run."""
    if len(TABLE) < len(SERVERS) * len(SIZES) * 2:
        pytest.skip("the corruption cases did not all run in this session")
    lines = ["| server | upload | corruption in transit | caught before the spool file is deleted? (by) |",
             "|---|---|---|---|"]
    lines += [f"| {s} | {k} | {c} | yes ({by}) |" for (s, k, c), by in sorted(TABLE.items())]
    (artifacts / "corruption-in-transit.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("kind", list(SIZES))
def test_crc32_integrity_computes_no_md5(s3_server, proxy_to, tmp_path, kind, monkeypatch):
    """On a server that checks CRC32 (auto chooses it), an upload hashes no byte with MD5: the cheaper mode."""
    proxy = proxy_to(s3_server)
    proxy.check_crc32 = True
    store = _store(proxy.url, _new_bucket(s3_server))
    store.profile()  # the probe may use MD5 (its multipart ETag style); the uploads may not

    md5, called = hashlib.md5, []

    def md5_outside_hsx(*args, **kwargs):  # moto (same process) hashes with MD5 for its own ETags
        if sys._getframe(1).f_globals.get("__name__", "").startswith("hsx."):
            called.append(sys._getframe(1).f_code.co_name)
        return md5(*args, **kwargs)

    monkeypatch.setattr(hashlib, "md5", md5_outside_hsx)
    data = os.urandom(SIZES[kind] * 2)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    assert store.put_file("k", path, len(data), sha).size == len(data)
    monkeypatch.undo()
    assert called == [], f"MD5 computed in crc32 integrity mode by {called}"
    head = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").head_object(
        Bucket=store.s.bucket, Key="p/k", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] and "ContentMD5" not in head and store.get_bytes("k", 7, 11) == data[7:11]


def test_crc32_forced_on_a_server_that_does_not_check_it_is_refused(rclone_server, tmp_path):
    """--s3-integrity crc32 on rclone (which stores a wrong CRC32 unchecked): refused, naming the flag, never passed."""
    store = _store(rclone_server, _new_bucket(rclone_server), integrity="crc32")
    with pytest.raises(PermanentStoreError, match="--s3-integrity crc32 .* a wrong x-amz-checksum-crc32 was accepted"):
        store.checks_line()
    data = os.urandom(SIZES["multipart"])
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    with pytest.raises(PermanentStoreError, match="--s3-integrity crc32"):
        store.put_file("k", path, len(data), hashlib.sha256(data).hexdigest())
    assert store.head("k") is None


@pytest.mark.parametrize("kind", list(SIZES))
def test_a_server_that_rejects_default_checksums(s3_server, proxy_to, tmp_path, kind):
    proxy = proxy_to(s3_server)
    proxy.reject_checksums = True
    bucket = _new_bucket(s3_server)
    data = os.urandom(SIZES[kind])
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store = _store(proxy.url, bucket)  # the default: checksums when_required
    # the integrity probe's CRC32 header is refused, but not as a mismatch: hsx keeps MD5 and sends no checksum header
    assert ("integrity md5 (probed: a wrong x-amz-checksum-crc32 was answered 400 InvalidArgument, which is no "
            "checksum refusal") in store.checks_line()
    proxy.rejected = 0
    assert store.put_file("k", path, len(data), sha).size == len(data) and store.get_bytes("k", 5, 9) == data[5:9]
    assert proxy.rejected == 0
    forced = _store(proxy.url, bucket, checksums="when_supported", multipart_etag="composite")
    with pytest.raises(PermanentStoreError) as refused:
        forced.put_file("k2", path, len(data), sha)
    message = str(refused.value)
    assert proxy.rejected >= 1 and "\n" not in message and "--s3-checksums when_required" in message, message
    assert forced.head("k2") is None


def test_a_whole_run_on_each_server(s3_endpoint, s3_endpoint_bucket, r, redis_server, tiny_model, proxy_to,
                                    tmp_path, monkeypatch, caplog, request):
    import hsx.store.s3
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    # every batch goes multipart (one part each: parts but the last must be >= 5 MiB)
    monkeypatch.setattr(hsx.store.s3, "S3Settings", functools.partial(S3Settings, multipart_threshold=1,
                                                                      multipart_chunk=5 * 2**20))
    proxy = proxy_to(s3_endpoint)
    settings = StoreSettings(url=f"s3://{s3_endpoint_bucket}/runs", endpoint_url=proxy.url, region="us-east-1",
                             addressing_style="path")
    spool_dir = tmp_path / "spool"
    rows = tmp_path / "rows.jsonl"   # the sample's first 48 conversations: 9 batches of 1024 tokens
    rows.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:48]))
    produce(produce_config(redis_server.url, tiny_model, settings, run="rs", dataset=rows, max_attempts=5))
    run_worker(worker_config(redis_server.url, spool_dir, run="rs"))
    proxy.corrupt, proxy.corrupt_left, proxy.corrupt_match = "flip", 2, "/batches/"
    caplog.set_level("INFO")
    rt = run_uploader(upload_config(redis_server.url, spool_dir))
    server = request.node.callspec.params["s3_endpoint"]
    if server == "seaweedfs":   # refused by the server (400 BadDigest on the part's CRC32), sent again within the upload
        assert proxy.corrupted == 2 and proxy.bad_digests == 2 + 2 and rt.failures == 0  # the probe's 2 wrong CRC32s too
    else:                       # found by hsx's check after the upload: the upload failed, and was tried again
        assert proxy.corrupted == 2 and rt.failures == 2
    style = {"moto": "composite", "rclone": "md5", "seaweedfs": "composite"}[server]
    said = {"moto": "integrity md5", "rclone": "integrity md5", "seaweedfs": "integrity crc32"}[server]
    assert any(m.startswith("run rs: store s3://") and f"multipart ETag {style} (probed)" in m and f"; {said} (probed"
               in m for m in caplog.messages), caplog.messages
    assert run_progress(r, "rs")["complete"] and not spool.spool_files(spool_dir, "rs")  # deleted after verify
    store = settings.open()
    assert verify_run(r, store, "rs").ok
    # the trainer's readers, in place: the follower (ledger order) and the range reader agree
    followed = {s["sample_id"]: s for s in RunFollower(redis_server.url, "rs", timeout_seconds=30)}
    ranged = RunDataset(settings, "rs", fetch="range")
    assert len(followed) == len(ranged) == ledger.run_totals(r, "rs")["samples"]
    for sid in list(followed)[::5]:
        assert torch.equal(followed[sid]["hidden_states"], ranged.get(sid)["hidden_states"])
    # corrupted at rest: found by verify, re-extracted by --repair
    spec = ledger.get_spec(r, "rs", "b0000001")
    key = "runs/" + layout.batch_key("rs", spec.shard, spec.batch_id)
    raw = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    obj = raw.get_object(Bucket=s3_endpoint_bucket, Key=key)
    data = bytearray(obj["Body"].read())
    data[-1] ^= 0x01
    raw.put_object(Bucket=s3_endpoint_bucket, Key=key, Body=bytes(data), Metadata=obj["Metadata"])
    report = verify_run(r, store, "rs")
    assert not report.ok and list(report.problems) == ["b0000001"]
    verify_run(r, store, "rs", repair=True)
    run_worker(worker_config(redis_server.url, spool_dir, run="rs"))
    run_uploader(upload_config(redis_server.url, spool_dir))
    assert run_progress(r, "rs")["complete"] and verify_run(r, store, "rs").ok
