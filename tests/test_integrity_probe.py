"""The S3 integrity probe (issue 37 item 1): only a checksum refusal, confirmed, makes the uploader trust the
server's CRC32 check.

moto stores a wrong x-amz-checksum-crc32 unchecked; tests/lyingstore.py's proxy in front of it answers the probe's
deliberately wrong PUT with a 503 SlowDown, a 500 or a 403 (or a lone 400 BadDigest) instead. The old probe read any
error as "the server checks CRC32" and went to crc32 mode for the life of the process: a byte flipped in transit
then passed (moto echoes the CRC32 it was sent). Now a passing answer is asked again and then md5 is kept, any
other answer keeps md5, and the start line says which. SeaweedFS (tests/seaweedfs.py) is the server that does
check: behind the same 503s, auto still settles on crc32 once its own answer comes through. --s3-integrity crc32
on a server that does not check it is refused at the uploader's start, in one line naming the flag.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from hsx.life import ledger
from hsx.runspec.config import StoreSettings
from hsx.store import PermanentStoreError, StoreError
from hsx_cli.main import main
from tests.manifests import example_manifest
from tests.test_cli_errors import one_error_line
from tests.test_s3_servers import _new_bucket, _store

KEY = "run/batches/00000/b0000000.safetensors"


@pytest.fixture
def proxy_to(request):
    from tests.lyingstore import LyingStoreProxy

    proxies = []

    def make(upstream: str):
        proxies.append(LyingStoreProxy(upstream, lies=0))
        return proxies[-1]

    yield make
    for proxy in proxies:
        proxy.stop()


def _spool_file(tmp_path, size: int = 100_000):
    data = os.urandom(size)
    path = tmp_path / "b0000000.safetensors"
    path.write_bytes(data)
    return path, data, hashlib.sha256(data).hexdigest()


def _flipped_upload_is_caught(store, proxy, tmp_path) -> str:
    """A byte flipped in transit on a single PUT: the StoreError that refuses it (the spool file is kept)."""
    path, data, sha = _spool_file(tmp_path)
    proxy.bad_digests = 0
    proxy.corrupt, proxy.corrupt_left, proxy.corrupt_match = "flip", 1, ""
    with pytest.raises(StoreError) as caught:
        store.put_file(KEY, path, len(data), sha)
    assert proxy.corrupted == 1 and path.read_bytes() == data
    return str(caught.value)


@pytest.mark.parametrize("fault", [(503, "SlowDown"), (500, "InternalError"), (403, "AccessDenied")])
def test_an_error_on_the_probe_is_no_checksum_refusal(fault, s3_server, proxy_to, tmp_path):
    """Every answer to the wrong-CRC32 PUT is the fault: md5 is kept, and corruption in transit is still caught.
    Before: crc32 mode on moto, the flipped byte passed (DID NOT RAISE)."""
    proxy = proxy_to(s3_server)
    proxy.fault_wrong_crc32, proxy.fault_left = fault, 1000
    store = _store(proxy.url, _new_bucket(s3_server))
    store.profile()
    proxy.fault_wrong_crc32 = None
    error = _flipped_upload_is_caught(store, proxy, tmp_path)
    assert "ETag" in error or "BadDigest" in error, error
    line = store.checks_line()
    status, code = fault
    said = (f"integrity md5 (probed: a wrong x-amz-checksum-crc32 was answered {status} {code} on 4 tries, never "
            "refused as a checksum mismatch: md5 kept" if status >= 500 else
            f"integrity md5 (probed: a wrong x-amz-checksum-crc32 was answered {status} {code}, which is no checksum "
            "refusal (400 BadDigest")
    assert said in line, line
    assert proxy.faulted == (4 if status >= 500 else 1)   # a passing answer asked again, a 403 not


def test_a_lone_checksum_refusal_is_confirmed_on_a_part(s3_server, proxy_to, tmp_path):
    """One 400 BadDigest on the probe's PUT (a middlebox's, not the server's): the wrong CRC32 on a part is then
    accepted, so md5 is kept. Before: crc32 on one unconfirmed refusal, the flipped byte passed."""
    proxy = proxy_to(s3_server)
    proxy.fault_wrong_crc32, proxy.fault_left = (400, "BadDigest"), 1
    store = _store(proxy.url, _new_bucket(s3_server))
    line = store.checks_line()
    assert ("integrity md5 (probed: a wrong x-amz-checksum-crc32 was refused (400 BadDigest) on a PUT, but a wrong "
            "x-amz-checksum-crc32 on a part was accepted: the server does not check it)") in line, line
    _flipped_upload_is_caught(store, proxy, tmp_path)


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_passing_errors_are_asked_again_until_the_server_answers(server, request, proxy_to, tmp_path):
    """Two 503s, then the server's own answer decides: moto accepts the wrong CRC32 (md5), SeaweedFS refuses it
    (crc32, and the flipped byte is refused by the server itself)."""
    upstream = request.getfixturevalue({"moto": "s3_server", "seaweedfs": "seaweedfs_server"}[server])
    proxy = proxy_to(upstream)
    proxy.fault_wrong_crc32, proxy.fault_left = (503, "SlowDown"), 2
    store = _store(proxy.url, _new_bucket(upstream))
    line = store.checks_line()
    retried = "after 2 retries (503 SlowDown, 503 SlowDown)"
    if server == "moto":
        assert f"integrity md5 (probed: a wrong x-amz-checksum-crc32 was accepted {retried}: the server does not " \
               "check it)" in line, line
        return
    assert (f"integrity crc32 (probed: a wrong x-amz-checksum-crc32 was refused (400 BadDigest {retried}), on a "
            "part too (400 BadDigest), the right ones stored)") in line, line
    assert "BadDigest" in _flipped_upload_is_caught(store, proxy, tmp_path) and proxy.bad_digests == 1


def test_forced_crc32_is_refused_where_the_server_does_not_check_it(s3_server, seaweedfs_server, tmp_path):
    """--s3-integrity crc32 on moto: refused in one line naming the flag, before any upload and at each one. On
    SeaweedFS it is probed and kept. Before: assumed, never probed, and a flipped single PUT passed."""
    store = _store(s3_server, _new_bucket(s3_server), integrity="crc32")
    with pytest.raises(PermanentStoreError) as refused:
        store.checks_line()
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--s3-integrity crc32 (HSX_S3_INTEGRITY) is set, but the store")
    assert "a wrong x-amz-checksum-crc32 was accepted" in message and "set --s3-integrity auto or md5" in message
    path, data, sha = _spool_file(tmp_path)
    with pytest.raises(PermanentStoreError, match="--s3-integrity crc32"):
        store.put_file(KEY, path, len(data), sha)
    assert store.head(KEY) is None
    checked = _store(seaweedfs_server, _new_bucket(seaweedfs_server), integrity="crc32")
    assert "integrity crc32 (set by --s3-integrity crc32, probed: a wrong x-amz-checksum-crc32 was refused (400 " \
           "BadDigest), on a part too" in checked.checks_line()
    assert checked.put_file(KEY, path, len(data), sha).size == len(data)


def test_the_uploader_refuses_forced_crc32_at_start(s3_server, r, redis_env, capsys, tmp_path):
    bucket = _new_bucket(s3_server)
    manifest = example_manifest("forced", store=f"s3://{bucket}/p")
    settings = StoreSettings(f"s3://{bucket}/p", endpoint_url=s3_server, region="us-east-1", addressing_style="path",
                             integrity="crc32")
    ledger.save_plan(r, "forced", type(manifest)(**{**manifest.__dict__, "store": settings}), [],
                     {"batches": 1, "samples": 1, "tokens": 8})
    assert main(["upload", "--burst", "--host", "checkhost", "--spool-dir", str(tmp_path / "spool"),
                 "--memory-spool-dir", str(tmp_path / "shm")]) == 2
    line = one_error_line(capsys, "upload")
    assert "uploader of run forced: --s3-integrity crc32 (HSX_S3_INTEGRITY) is set" in line, line
    assert "not shown to verify x-amz-checksum-crc32" in line, line
