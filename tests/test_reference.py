"""Stored hidden states equal a plain Hugging Face forward of each sample alone, on plain and agentic rows."""

import json

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from hsx.batch import batchfile
from hsx.life import ledger
from hsx.prep.rows import read_conversation
from hsx.runspec.config import StoreSettings
from hsx.store import open_store
from hsx_tools.demo import sample_dataset
from tests.pipeline import planned_specs, run_pipeline

AGENTIC = sample_dataset().with_name("sample_agentic.jsonl")


def _rows_by_id():
    return {row["id"]: row for path in (sample_dataset(), AGENTIC) for row in map(json.loads, path.read_text().splitlines())}


def _as_the_template_takes(messages):
    """The tiny model's template dumps tool-call arguments with tojson and writes a content as it is: string
    arguments parsed, a null content as ""."""
    out = []
    for msg in messages:
        msg = {**msg, "content": msg["content"] or ""}
        if msg.get("tool_calls"):
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])
                                                     if isinstance(c["function"]["arguments"], str)
                                                     else c["function"]["arguments"]}} for c in msg["tool_calls"]]
        out.append(msg)
    return out


def _messages(row):
    if "messages" in row:
        return row["messages"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]


def _check_run(r, store, run, model_path, tolerance, samples=160):
    manifest = ledger.get_manifest(r, run)
    layer_ids, store_final = list(manifest.layer_ids), manifest.store_final
    ref = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    num_layers = ref.config.num_hidden_layers
    rows, checked, padded_batches = _rows_by_id(), 0, 0
    for spec in planned_specs(r, run, store).values():   # ids from the store (issue 42)
        key = f"{run}/batches/{spec.shard}/{spec.batch_id}.safetensors"
        got = batchfile.read_batch_bytes(store.get_bytes(key), where=key)
        assert got.sample_ids == spec.sample_ids
        assert got.hidden_states.shape == (spec.tokens, len(layer_ids) * ref.config.hidden_size)
        padded_batches += spec.padded > spec.tokens
        for b, sample_id in enumerate(got.sample_ids):
            lo, hi = int(got.cu_seqlens[b]), int(got.cu_seqlens[b + 1])
            row = rows[sample_id]
            conv = read_conversation(row)
            want = tok.apply_chat_template(_as_the_template_takes(conv.messages), tools=conv.tools, tokenize=True,
                                           return_dict=True,
                                           return_assistant_tokens_mask=True)
            expected_ids = list(want["input_ids"])
            assert got.input_ids[lo:hi].tolist() == expected_ids
            # The loss mask is the template's own account of the assistant bodies ({% generation %} blocks).
            assert got.loss_mask[lo:hi].tolist() == np.asarray(want["assistant_masks"]).tolist()
            if sample_id.startswith("conv-"):   # plain rows: exactly the assistant contents + end-of-turn markers
                masked = tok.decode(got.input_ids[lo:hi][got.loss_mask[lo:hi].bool()].tolist())
                assert masked == "".join(m["content"] + "<|im_end|>\n" for m in _messages(row) if m["role"] == "assistant")
            with torch.no_grad():
                out = ref(input_ids=torch.tensor([expected_ids]), output_hidden_states=True)
            want = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
            torch.testing.assert_close(got.hidden_states[lo:hi].float(), want, **tolerance)
            if store_final:
                torch.testing.assert_close(got.final_hidden_states[lo:hi].float(), out.hidden_states[num_layers][0], **tolerance)
            checked += 1
    assert checked == ledger.run_totals(r, run)["samples"] == samples
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


def test_eagle3_bf16_with_final_state_and_last_layer(r, redis_server, tmp_path, tiny8_model):
    model = tiny8_model
    run_pipeline(redis_server.url, model, str(tmp_path / "store"), tmp_path / "spool", run="e3",
                 layers="eagle3", dtype="bfloat16", pad_multiple=32)
    assert ledger.get_manifest(r, "e3").layer_ids == (1, 3, 4)
    _check_run(r, open_store(str(tmp_path / "store")), "e3", model, dict(atol=3e-2, rtol=2e-2))


def test_explicit_layers_include_the_last_layer(r, redis_server, tiny_model, tmp_path):
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="last",
                 layers="0,5")
    _check_run(r, open_store(str(tmp_path / "store")), "last", tiny_model, dict(atol=1e-5, rtol=1e-4))


def test_agentic_rows_with_reasoning_and_tool_calls_equal_reference(r, redis_server, tiny_model, tmp_path):
    """Reasoning dropped from history turns, tool calls, consecutive tool results, tools in the system turn."""
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="agentic",
                 dataset=AGENTIC, max_length=4096, token_budget=4096, layers="dflash:3")
    _check_run(r, open_store(str(tmp_path / "store")), "agentic", tiny_model, dict(atol=1e-5, rtol=1e-4), samples=40)
