"""The run manifest is one typed, frozen object (issue 21 item 2): read and written in one place, old manifests
still read, a newer format refused, keys it does not know kept; derived facts are its properties."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest

from hsx import defaults as D
from hsx.life import ledger
from hsx.monitor.progress import run_progress
from hsx.runspec.manifest import FORMAT, Manifest, ManifestError, ManifestMismatch, check_same_run
from tests.manifests import example_manifest

ROOT = Path(__file__).resolve().parents[1]

# A manifest as the first hsx wrote it (commit 2614f48's build_manifest): no store_dtype, codec,
# compute_dtype, limits, template_kwargs, columns or window_rows, and paths as the user typed them.
OLD = {
    "run": "old", "model": "./tiny-model", "model_config_hash": "a" * 64, "model_type": "qwen3", "num_layers": 4,
    "hidden_size": 64, "layer_preset": "dflash:3", "layer_ids": [1, 2, 3], "store_final": False, "dtype": "float32",
    "max_length": 512, "overlong": "truncate", "token_budget": 1024, "pad_multiple": 8, "max_batch_rows": 64,
    "batches_per_shard": 1000, "dataset": "data/rows.jsonl", "dataset_fingerprint": "d" * 64,
    "chat_template_hash": "c" * 64, "pad_token_id": 0, "store_url": "relstore",
    "store": {"url": "relstore", "endpoint_url": None, "region": None, "addressing_style": "auto", "verify_etag": True},
    "hsx_version": "0.1.0", "created": "2026-12-02T10:00:00+00:00", "format": "hsx-run/1",
}
# The keys `hsx produce` has written since issue 22 (the JSON stays as it was: same keys).
KEYS_WRITTEN = {"batches_per_shard", "chat_template_hash", "codec", "columns", "compute_dtype", "created", "dataset",
                "dataset_fingerprint", "dtype", "format", "fp8_accumulation", "hidden_size", "hsx_version", "layer_ids", "layer_preset",
                "limits", "max_batch_rows", "max_length", "model", "model_config_hash", "model_type", "num_layers",
                "overlong", "pad_multiple", "pad_token_id", "run", "store", "store_dtype", "store_final", "store_url",
                "template_kwargs", "token_budget", "window_rows"}


def test_an_old_manifest_reads_with_the_values_it_meant_and_its_relative_paths_warn(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hsx.runspec.manifest"):
        m = Manifest.from_json(json.dumps(OLD), "old manifest")
    assert (m.store_dtype, m.codec, m.compute_dtype, m.fp8_accumulation) == ("float32", "none", "bfloat16", "fp32")
    assert (m.limits.max_attempts, m.limits.lease_seconds) == (D.DEFAULT_MAX_ATTEMPTS, D.DEFAULT_LEASE_SECONDS)
    assert m.window_rows is None
    assert dict(m.template_kwargs) == {} and dict(m.columns) == {} and m.layer_ids == (1, 2, 3)
    # Relative paths are read from here (what the roles of that hsx did), each said once.
    assert m.store_url == m.store.url == str(tmp_path / "relstore")
    assert m.dataset == str(tmp_path / "data/rows.jsonl") and m.model == str(tmp_path / "tiny-model")
    warned = [r.getMessage() for r in caplog.records]
    assert any("run old's store_url relstore is a relative path (an older hsx planned it)" in w for w in warned), warned
    assert len(warned) == 4, warned
    caplog.clear()
    Manifest.from_dict(OLD)
    assert not caplog.records                      # once a process, not at every read (the dashboard reads often)
    # The same run as a call from here with the absolute path (and any other store is another run).
    new = example_manifest("old", store=str(tmp_path / "relstore"), **{k: m.to_dict()[k] for k in (
        "model_config_hash", "hidden_size", "num_layers", "max_length", "overlong", "token_budget", "pad_multiple",
        "max_batch_rows", "dataset_fingerprint", "chat_template_hash", "dtype", "store_dtype")}, window_rows=None)
    check_same_run(m, new)
    with pytest.raises(ManifestMismatch, match="hsx reset --run old --store STORE"):
        check_same_run(m, dataclasses.replace(new, store_url=str(tmp_path / "other")))


def test_fp8_accumulation_of_an_older_manifest_is_what_its_run_did():
    """Before --fp8-accumulation, float8 runs accumulated the fast way: read so, a resume with the new default
    is refused by name (their stored layers would mix two accumulations), and `fast` resumes them."""
    older = {k: v for k, v in example_manifest("o8", compute_dtype="float8").to_dict().items() if k != "fp8_accumulation"}
    m = Manifest.from_dict(older)
    assert (m.compute_dtype, m.fp8_accumulation) == ("float8", "fast")
    now = example_manifest("o8", compute_dtype="float8")
    assert now.fp8_accumulation == "fp32"
    with pytest.raises(ManifestMismatch, match="fp8_accumulation: run has 'fast', this call has 'fp32'"):
        check_same_run(m, now)
    check_same_run(m, dataclasses.replace(now, fp8_accumulation="fast"))
    with pytest.raises(ManifestError, match="fp8_accumulation is 3"):
        Manifest.from_dict({**now.to_dict(), "fp8_accumulation": 3})


def test_written_json_has_the_keys_hsx_always_wrote_and_reads_back_equal():
    m = example_manifest("w")
    assert set(m.to_dict()) == KEYS_WRITTEN and m.to_dict()["format"] == FORMAT == "hsx-run/1"
    assert Manifest.from_json(m.to_json()) == m == Manifest.from_json(m.to_json(indent=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.store_dtype = "float8_e4m3"


def test_a_newer_format_is_refused_and_unknown_keys_are_kept():
    newer = {**example_manifest("n").to_dict(), "format": "hsx-run/2"}
    with pytest.raises(ManifestError) as err:
        Manifest.from_dict(newer, "Redis hsx:n:manifest")
    assert re.fullmatch(r"Redis hsx:n:manifest: format hsx-run/2 is newer than this hsx \S+ reads \(hsx-run/1\); "
                        r"upgrade hsx on this host", str(err.value)), str(err.value)
    # Same format, a key this hsx does not know (a newer hsx's note): kept as read, written back unchanged.
    noted = {**example_manifest("n").to_dict(), "trainer_note": {"by": "a newer hsx"}}
    m = Manifest.from_dict(noted)
    assert dict(m.extra) == {"trainer_note": {"by": "a newer hsx"}} and m.to_dict() == noted


@pytest.mark.parametrize("change, named", [
    ({"layer_ids": ["1", "2"]}, "layer_ids ['1', '2'] are not all integers"),
    ({"hidden_size": True}, "hidden_size is True, not int"),
    ({"store_final": 1}, "store_final is 1, not bool"),
    ({"limits": {"max_attempts": "3"}}, "limits {'max_attempts': '3'} are not all integers"),
    ({"format": "something-else"}, "format 'something-else' is not an hsx run manifest"),
    ({"store": {"url": "s3://b/p", "addressing_style": "sideways"}}, "store: S3 addressing style"),
    ({"store": {"url": "s3://b/p", "checksums": "always"}}, "store: --s3-checksums must be one of"),
    ({"store": {"url": "s3://b/p", "multipart_etag": "sha1"}}, "store: --s3-multipart-etag must be one of"),
    ({"store": {"url": "s3://b/p", "integrity": "sha1"}}, "store: --s3-integrity must be one of"),
])
def test_a_bad_field_is_one_line_naming_it(change, named):
    with pytest.raises(ManifestError, match=f"^where: {re.escape(named)}"):
        Manifest.from_dict({**example_manifest().to_dict(), **change}, "where")
    data = example_manifest().to_dict()
    del data["token_budget"]
    with pytest.raises(ManifestError, match="^where: no token_budget"):
        Manifest.from_dict(data, "where")


def test_derived_facts():
    m = example_manifest(layer_ids=(1, 2, 3), hidden_size=64, dtype="bfloat16", store_dtype="bfloat16")
    assert (m.stored_rows, m.width, m.stored_layer_names) == (3, 192, [1, 2, 3])
    assert m.host_bytes_per_token == 3 * 64 * 2 and m.bytes_per_token == 3 * 64 * 2 + 5 and not m.fp8_store
    final = dataclasses.replace(m, store_final=True)
    assert (final.stored_rows, final.width, final.stored_layer_names) == (4, 192, [1, 2, 3, "final"])
    fp8 = dataclasses.replace(m, store_dtype="float8_e4m3", codec="zstd")
    # 3 rows x (64 one-byte values + a float32 scale) x zstd's measured 0.82 + 5: what `hsx inspect` prints
    assert fp8.fp8_store and fp8.host_bytes_per_token == 3 * 68 and fp8.bytes_per_token == 172


def test_redis_holds_the_same_json_and_a_view_names_a_bad_one(r):
    m = example_manifest("rd")
    ledger.save_plan(r, "rd", m, [], {"batches": 0})
    assert ledger.get_manifest(r, "rd") == m and json.loads(r.get("hsx:rd:manifest")) == m.to_dict()
    r.set("hsx:rd:manifest", json.dumps({**m.to_dict(), "format": "hsx-run/3"}))
    with pytest.raises(ManifestError, match="^Redis hsx:rd:manifest: format hsx-run/3 is newer"):
        ledger.get_manifest(r, "rd")
    p = run_progress(r, "rd")           # status and the dashboard never fail on it: they name it
    assert p["store_dtype"] is None and any("format hsx-run/3 is newer" in line for line in p["malformed"])


def test_no_role_reads_the_manifest_by_key():
    rooms = ("hsx", "producer", "gpu_worker", "uploader", "dashboard", "hsx_reader", "hsx_tools", "hsx_cli", "peers",
             "bench", "scripts")
    found = [f"{path.relative_to(ROOT)}:{n}" for room in rooms for path in sorted((ROOT / room).rglob("*.py"))
             if path != ROOT / "hsx" / "manifest.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"manifest(\(\))?(\[|\.get\()", line)]
    assert not found, found
