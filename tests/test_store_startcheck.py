"""The store's start check (issue 31 item 3): a wrong S3 endpoint, a missing bucket, refused credentials are
one line naming the setting, within seconds, in produce, worker, upload and verify."""

from __future__ import annotations

import time

import boto3
import pytest

from hsx.life import ledger
from hsx.runspec.config import StoreSettings
from hsx.store.startcheck import START_CHECK_SECONDS, WRITE_CHECK_KEY, StoreUnusable, check_store
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from tests.faultproxy import FaultProxy
from tests.manifests import example_manifest
from tests.test_cli_errors import free_port, one_error_line

ENDPOINT_FLAG = "--s3-endpoint-url / HSX_S3_ENDPOINT_URL"


def test_produce_with_a_wrong_endpoint_says_so_in_one_line_within_seconds(tiny_model, tmp_path, capsys, redis_env,
                                                                          s3_server):
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    code = main(["produce", "--dataset", str(sample_dataset()), "--model", str(tiny_model), "--layers", "dflash:3",
                 "--store", "s3://bucket/prefix", "--s3-endpoint-url", dead, "--run", "wrongep"])
    seconds = time.monotonic() - t0
    line = one_error_line(capsys, "produce")
    assert code == 2 and ENDPOINT_FLAG in line and dead in line and "cannot reach" in line, line
    assert seconds < 3 * START_CHECK_SECONDS, seconds  # was 58 s, after 7 retry warnings


def test_a_missing_bucket_names_the_bucket_and_store_flag(s3_server):
    with pytest.raises(StoreUnusable) as caught:
        check_store(StoreSettings("s3://no-such-bucket-here/p", endpoint_url=s3_server, region="us-east-1"), "produce")
    assert "bucket 'no-such-bucket-here' does not exist" in str(caught.value)
    assert "--store / HSX_STORE" in str(caught.value) and "\n" not in str(caught.value)


def test_refused_credentials_and_writes_name_the_credentials(s3_server, s3_bucket):
    proxy = FaultProxy(int(s3_server.rsplit(":", 1)[1]))
    proxy.set_mode("forbidden")
    try:
        with pytest.raises(StoreUnusable, match="refused the credentials .*AWS_ACCESS_KEY_ID"):
            check_store(StoreSettings(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, region="us-east-1",
                                      addressing_style="path"), "worker", run="r1")
    finally:
        proxy.stop()


def test_a_good_store_passes_and_its_write_check_lies_outside_every_run(s3_server, s3_bucket):
    settings = StoreSettings(f"s3://{s3_bucket}/runs", endpoint_url=s3_server, region="us-east-1")
    check_store(settings, "produce")
    check_store(settings, "produce")  # the same bytes again: idempotent
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
            .list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys == [f"runs/{WRITE_CHECK_KEY}"]
    check_store(StoreSettings("/tmp/a-local-store"), "produce")  # local: nothing here (hsx/localdirs.py checks it)


@pytest.mark.parametrize("argv", [
    ["verify", "--run", "badep"],
    ["upload", "--burst", "--host", "checkhost", "--spool-dir", "{tmp}/spool", "--memory-spool-dir", "{tmp}/shm"],
    ["worker", "--run", "badep", "--device", "cpu", "--spool-dir", "{tmp}/spool", "--memory-spool-dir", "{tmp}/shm"],
])
def test_roles_that_read_the_store_from_the_manifest_check_it_at_start(argv, r, redis_env, capsys, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    manifest = example_manifest("badep", store="s3://bucket/p")
    manifest = type(manifest)(**{**manifest.__dict__, "store": StoreSettings("s3://bucket/p", endpoint_url=dead)})
    ledger.save_plan(r, "badep", manifest, [], {"batches": 1, "samples": 1, "tokens": 8})
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    line = one_error_line(capsys, argv[0])
    assert "cannot reach the S3 store s3://bucket/p at " + dead in line and ENDPOINT_FLAG in line, line
    assert "recorded by `hsx produce`" in line, line


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "minio:9000", "ftp://127.0.0.1:9000"])
def test_an_endpoint_without_http_is_exit_2_naming_the_scheme(endpoint, tiny_model, tmp_path, capsys, redis_env):
    """Issue 41 item 2: was exit 1, "unexpected error: ValueError: Invalid endpoint: 127.0.0.1:9000"."""
    code = main(["produce", "--dataset", str(sample_dataset()), "--model", str(tiny_model), "--layers", "dflash:3",
                 "--store", "s3://bucket/prefix", "--s3-endpoint-url", endpoint, "--run", "noscheme"])
    line = one_error_line(capsys, "produce")
    assert code == 2, line
    assert f"S3 endpoint {endpoint!r} needs a scheme: http:// or https://" in line and ENDPOINT_FLAG in line, line
    assert "unexpected error" not in line


def test_no_credentials_at_all_names_the_credentials_not_the_endpoint(s3_server, s3_bucket, monkeypatch, tmp_path):
    """Issue 41 item 3: no AWS credentials anywhere was "cannot reach the S3 store ... check --s3-endpoint-url"."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata service here: answer at once
    with pytest.raises(StoreUnusable) as caught:
        check_store(StoreSettings(f"s3://{s3_bucket}/p", endpoint_url=s3_server, region="us-east-1"), "produce")
    line = str(caught.value)
    assert "found no AWS credentials" in line and "AWS_ACCESS_KEY_ID" in line and "\n" not in line, line
    assert "cannot reach" not in line and ENDPOINT_FLAG not in line, line
