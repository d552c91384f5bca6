"""A complete run manifest for tests that plant a run in Redis without planning one."""

from __future__ import annotations

from hsx.runspec.config import StoreSettings
from hsx.runspec.manifest import Manifest, RunLimits, new_manifest


def example_manifest(run: str = "r", store: str = "/tmp/hsx-test-store", **changes) -> Manifest:
    """A manifest as `hsx produce` would write for a small model (3 layers, H = 64); ``changes`` override fields."""
    fields = dict(
        run=run, model="/models/tiny", model_config_hash="0" * 64, model_type="qwen3", num_layers=4, hidden_size=64,
        layer_preset="dflash:3", layer_ids=(1, 2, 3), store_final=False, dtype="bfloat16", store_dtype="bfloat16",
        codec="none", compute_dtype="bfloat16", fp8_accumulation="fp32", max_length=512, overlong="drop", token_budget=1024, pad_multiple=8,
        max_batch_rows=64, batches_per_shard=1000, window_rows=20000, dataset="/data/rows.jsonl",
        dataset_fingerprint="f" * 64, chat_template_hash="c" * 64, template_kwargs={}, columns={}, pad_token_id=0,
        store_url=store, store=StoreSettings(url=store), limits=RunLimits())
    return new_manifest(**{**fields, **changes})
