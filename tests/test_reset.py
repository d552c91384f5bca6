"""`hsx reset --store` on a local store: the run's folder goes with its objects (issue 31 item 8)."""

from __future__ import annotations

from hsx.life import ledger
from hsx.life.reset import apply_reset, plan_reset
from hsx.store.local import LocalStore
from tests.manifests import example_manifest


def test_reset_of_a_local_store_leaves_no_empty_folder_of_the_run(tmp_path, r):
    store = LocalStore(tmp_path / "store")
    for key in ("gone/manifest.json", "gone/inputs/00000/b0000000.safetensors",
                "gone/batches/00000/b0000000.safetensors", "kept/inputs/00000/b0000000.safetensors"):
        store.put_bytes(key, b"x")
    (tmp_path / "store/gone/batches/00000/.b0000001.safetensors.tmp-123").write_bytes(b"killed writer")
    ledger.save_plan(r, "gone", example_manifest("gone"), [], {"batches": 0, "samples": 0, "tokens": 0})
    plan = plan_reset(r, "gone", store)
    apply_reset(r, plan, store)
    assert not (tmp_path / "store/gone").exists(), sorted(str(p) for p in (tmp_path / "store").rglob("*"))
    assert store.list_keys("kept/") == ["kept/inputs/00000/b0000000.safetensors"]
    assert not r.keys("hsx:gone:*")


def test_reset_names_the_runs_folder_with_one_slash_between_parts(tmp_path, r, s3_server, s3_bucket):
    """Issue 41 item 10: an S3 store's summary said s3://b/runs//gone/ (the prefix's slash twice)."""
    from hsx.store import StoreSettings

    ledger.save_plan(r, "gone", example_manifest("gone"), [], {"batches": 0, "samples": 0, "tokens": 0})
    for url, expected in ((f"s3://{s3_bucket}/runs", f"s3://{s3_bucket}/runs/gone/"),
                          (f"s3://{s3_bucket}/runs/", f"s3://{s3_bucket}/runs/gone/"),
                          (f"s3://{s3_bucket}", f"s3://{s3_bucket}/gone/"),
                          (str(tmp_path / "store"), f"{tmp_path / 'store' / 'gone'}/")):
        store = StoreSettings(url, endpoint_url=s3_server, region="us-east-1").open()
        assert plan_reset(r, "gone", store).summary().endswith(f"0 objects under {expected}"), url
