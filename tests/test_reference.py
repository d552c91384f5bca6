"""Stored hidden states equal a plain Hugging Face forward of each sample alone."""

import json

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hsx import batchfile, ledger
from hsx.config import StoreSettings
from hsx_tools.demo import sample_dataset
from hsx.store import open_store
from hsx_tools.tinymodel import build_tiny_model
from tests.pipeline import run_pipeline


def _rows_by_id():
    return {row["id"]: row for row in map(json.loads, sample_dataset().read_text().splitlines())}


def _messages(row):
    if "messages" in row:
        return row["messages"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]


def _check_run(r, store, run, model_path, tolerance):
    manifest = ledger.get_manifest(r, run)
    layer_ids, store_final = manifest["layer_ids"], manifest["store_final"]
    ref = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    num_layers = ref.config.num_hidden_layers
    rows, checked, padded_batches = _rows_by_id(), 0, 0
    for spec in ledger.all_specs(r, run).values():
        key = f"{run}/batches/{spec.shard}/{spec.batch_id}.safetensors"
        got = batchfile.read_bytes(store.get_bytes(key), where=key)
        assert got.sample_ids == spec.sample_ids
        assert got.hidden_states.shape == (spec.tokens, len(layer_ids) * ref.config.hidden_size)
        padded_batches += spec.padded > spec.tokens
        for b, sample_id in enumerate(got.sample_ids):
            lo, hi = int(got.cu_seqlens[b]), int(got.cu_seqlens[b + 1])
            messages = _messages(rows[sample_id])
            expected_ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
            assert got.input_ids[lo:hi].tolist() == list(expected_ids)
            # The loss mask covers exactly the assistant turns (content + end-of-turn marker).
            masked = tok.decode(got.input_ids[lo:hi][got.loss_mask[lo:hi].bool()].tolist())
            assert masked == "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
            with torch.no_grad():
                out = ref(input_ids=torch.tensor([expected_ids]), output_hidden_states=True)
            want = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            torch.testing.assert_close(got.hidden_states[lo:hi].float(), want, **tolerance)
            if store_final:
                torch.testing.assert_close(got.final_hidden_states[lo:hi].float(), out.hidden_states[num_layers][0], **tolerance)
            checked += 1
    assert checked == ledger.run_totals(r, run)["samples"] == 160
    return padded_batches


def test_dflash_over_s3_equals_reference(r, redis_server, tiny_model, s3_server, s3_bucket, tmp_path):
    settings = StoreSettings(url=f"s3://{s3_bucket}/runs", endpoint_url=s3_server, region="us-east-1",
                             addressing_style="path")
    # A large pad multiple makes every batch padding-heavy.
    run_pipeline(redis_server.url, tiny_model, settings, tmp_path / "spool", run="ref", pad_multiple=64,
                 layers="dflash:3")
    store = open_store(settings.url, s3_server, "us-east-1", "path")
    padded = _check_run(r, store, "ref", tiny_model, dict(atol=1e-5, rtol=1e-4))
    assert padded >= 5


def test_eagle3_bf16_with_final_state_and_last_layer(r, redis_server, tmp_path):
    model = build_tiny_model(tmp_path / "tiny8", num_layers=8, sample_path=sample_dataset())
    run_pipeline(redis_server.url, model, str(tmp_path / "store"), tmp_path / "spool", run="e3",
                 layers="eagle3", dtype="bfloat16", pad_multiple=32)
    assert ledger.get_manifest(r, "e3")["layer_ids"] == [1, 3, 4]
    _check_run(r, open_store(str(tmp_path / "store")), "e3", model, dict(atol=3e-2, rtol=2e-2))


def test_explicit_layers_include_the_last_layer(r, redis_server, tiny_model, tmp_path):
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="last",
                 layers="0,5")
    _check_run(r, open_store(str(tmp_path / "store")), "last", tiny_model, dict(atol=1e-5, rtol=1e-4))
