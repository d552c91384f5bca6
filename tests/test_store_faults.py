"""Issue 23 items 8-10 against moto's S3 server: corrupt inputs repaired by their bytes, a store whose HEAD
lies caught by the read-back check, incomplete multipart uploads of a killed uploader found and aborted."""

import hashlib
from pathlib import Path

import boto3
import pytest

from hsx.life import UploadJob, batchlife, ledger
from hsx.monitor.progress import run_progress
from hsx.runspec.config import StoreSettings
from hsx.store import layout, open_store
from hsx_tools.demo import sample_dataset
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import produce_config, upload_config, worker_config


def _settings(endpoint: str, bucket: str) -> StoreSettings:
    return StoreSettings(url=f"s3://{bucket}/runs", endpoint_url=endpoint, region="us-east-1", addressing_style="path")


def _s3(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _rows(tmp_path) -> Path:
    """The sample's first 48 conversations: 9 batches of 1024 tokens (every input and batch object goes to S3)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:48]))
    return rows


def test_corrupt_inputs_on_s3_are_rewritten_by_their_bytes(r, redis_server, tiny_model, s3_server, s3_bucket, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    settings = _settings(s3_server, s3_bucket)
    cfg = produce_config(redis_server.url, tiny_model, settings, run="ci", max_attempts=2)
    produce(cfg)
    spec = ledger.get_spec(r, "ci", "b0000001")
    key = "runs/" + layout.input_key("ci", spec.shard, spec.batch_id)
    s3 = _s3(s3_server)
    obj = s3.get_object(Bucket=s3_bucket, Key=key)
    data = bytearray(obj["Body"].read())
    data[-1] ^= 0x01  # the last byte of cu_seqlens' padding-free data: same size
    # Corrupted at rest: the object's bytes changed, its sha256 metadata still names the digest of the good bytes.
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data), Metadata=obj["Metadata"])
    assert obj["Metadata"]["sha256"] == spec.input_sha256 != hashlib.sha256(data).hexdigest()
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="ci"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    dead = ledger.dead_letters(r, "ci")
    assert list(dead) == ["b0000001"] and "differ from the SHA-256 the producer recorded" in dead["b0000001"]["last_error"]
    produce(cfg)  # re-run: the input object is read back and hashed, and rewritten
    stored = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == spec.input_sha256
    assert batchlife.retry(r, "ci") == ["b0000001"]
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="ci"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    store = open_store(settings.url, s3_server, "us-east-1", "path")
    assert run_progress(r, "ci")["complete"] and verify_run(r, store, "ci").ok


@pytest.fixture
def lying_store(s3_server):
    from tests.lyingstore import LyingStoreProxy

    proxy = LyingStoreProxy(s3_server)
    yield proxy
    proxy.stop()


def _objects(endpoint: str, bucket: str, run: str) -> set[str]:
    pages = _s3(endpoint).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"runs/{run}/batches/")
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def test_a_store_whose_head_lies_is_caught_by_read_back(r, redis_server, tiny_model, s3_server, s3_bucket,
                                                          lying_store, tmp_path):
    from gpu_worker.worker import run_worker
    from uploader.worker import run_uploader

    settings = _settings(lying_store.url, s3_bucket)
    direct = open_store(settings.url, s3_server, "us-east-1", "path")
    # HEAD-only verification (the default): the store loses 3 objects, HEAD answers for them, all "done".
    rows = _rows(tmp_path)
    produce(produce_config(redis_server.url, tiny_model, settings, run="lh1", dataset=rows))
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="lh1"))
    run_uploader(upload_config(redis_server.url, tmp_path / "spool"))
    planned = ledger.run_totals(r, "lh1")["batches"]
    assert run_progress(r, "lh1")["complete"] and len(_objects(s3_server, s3_bucket, "lh1")) == planned - 3
    lying = open_store(settings.url, lying_store.url, "us-east-1", "path")
    assert verify_run(r, lying, "lh1", quick=True).ok  # --quick trusts HEAD, as the upload did
    report = verify_run(r, lying, "lh1")                # the full verify reads every object: 3 missing
    assert not report.ok and len(report.problems) == 3
    assert all("missing from the store" in problem for problem in report.problems.values())
    # --verify-readback: each object is read back before it is recorded done; the lost ones are uploaded again.
    lying_store.lies_left, heads = 3, lying_store.lied_heads
    produce(produce_config(redis_server.url, tiny_model, settings, run="lh2", dataset=rows))
    run_worker(worker_config(redis_server.url, tmp_path / "spool", run="lh2"))
    rt = run_uploader(upload_config(redis_server.url, tmp_path / "spool", verify_readback=True))
    assert lying_store.lied_heads - heads >= 3 and rt.failures == 3
    assert run_progress(r, "lh2")["complete"] and len(_objects(s3_server, s3_bucket, "lh2")) == planned
    assert verify_run(r, direct, "lh2").ok


def test_incomplete_multipart_uploads_are_reported_and_stale_ones_aborted(r, redis_server, tiny_model, s3_server,
                                                                           s3_bucket, lying_store, tmp_path):
    import math
    import time

    from tests.waiting import scaled
    from uploader.worker import run_uploader

    lying_store.lies_left = 0  # an honest store; the proxy gives each upload its true start time
    settings = _settings(lying_store.url, s3_bucket)
    # the young upload must stay younger than a lease through verify and the uploader's start-up: 5 s on a quiet
    # machine, stretched on a loaded one (at load 6-7 on 2 cores those two took more than 5 s)
    lease = math.ceil(scaled(5))
    produce(produce_config(redis_server.url, tiny_model, settings, run="mp", dataset=_rows(tmp_path), enqueue=False,
                           lease_seconds=lease))
    s3 = _s3(lying_store.url)
    specs = ledger.all_specs(r, "mp")

    def start(bid: str, run: str = "mp") -> str:
        key = "runs/" + layout.batch_key(run, specs[bid].shard, bid)
        upload = s3.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
        s3.upload_part(Bucket=s3_bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
        return key

    killed = start("b0000000")   # an uploader killed mid-upload
    live = start("b0000001")     # another uploader's upload in progress: it holds its batch's lease
    with batchlife.uploading(r, "mp", "b0000001", UploadJob("otherhost", "", 0, ""), 600):  # until that uploader dies too
        other_run = start("b0000002", run="notarun")  # not a run of this Redis: not ours to touch
        time.sleep(lease + 0.5)      # the run's lease length on the store's clock
        young = start("b0000003")    # started just now (no lease seen: the listing may run ahead of a lease read)
        store = open_store(settings.url, lying_store.url, "us-east-1", "path")
        report = verify_run(r, store, "mp")
        assert not report.ok and [u.split(" ")[0] for u in report.stale_uploads] == [killed.removeprefix("runs/")]
        assert report.live_uploads == 2 and any("incomplete multipart uploads of killed uploaders" in line
                                                for line in report.lines())
        run_uploader(upload_config(redis_server.url, tmp_path / "spool"))  # start-up aborts the stale one only
        left = {u["Key"] for u in s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])}
        assert left == {live, other_run, young}
    # that uploader died too (its lease is gone): its upload is stale now
    repaired = verify_run(r, store, "mp", repair=True)
    assert live.removeprefix("runs/") in repaired.aborted_uploads and "aborted" in repaired.lines()[-1]
    left = {u["Key"] for u in s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])}
    assert live not in left and other_run in left
    assert not verify_run(r, store, "mp").stale_uploads
