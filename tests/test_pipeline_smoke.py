import json

from hsx.monitor.progress import run_progress
from tests.pipeline import planned_specs, run_pipeline


def test_local_store_run_completes(r, redis_server, tiny_model, tmp_path):
    store = tmp_path / "store"
    report = run_pipeline(redis_server.url, tiny_model, str(store), tmp_path / "spool", run="smoke")
    p = run_progress(r, "smoke")
    assert p["complete"] and p["done"]["batches"] == report.batches > 1
    assert p["done"]["samples"] == 160
    assert len(list((store / "smoke" / "batches").rglob("*.safetensors"))) == report.batches
    index = [json.loads(line) for line in (store / "smoke" / "index.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in index) == sorted(s for spec in planned_specs(r, "smoke").values() for s in spec.sample_ids)
    assert not list((tmp_path / "spool").rglob("*.safetensors"))
