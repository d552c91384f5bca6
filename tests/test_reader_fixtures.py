"""Shared by tests/test_reader*.py and tests/test_export*.py: two real runs of the tiny model, and what a
plain Hugging Face forward gives for every sample of them (token ids from the chat template, hidden states)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hsx_tools.demo import sample_dataset
from tests.pipeline import run_pipeline


@dataclass
class RefRun:
    store: Path          # local store root
    run: str
    model: Path
    layer_ids: list[int]
    expected: dict       # sample id -> {"input_ids", "assistant_text", "hidden_states" [T, n*H], "final" [T, H]}
    hf: tuple            # (AutoModel in float32, tokenizer)


def _messages(row):
    if "messages" in row:
        return row["messages"]
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]


def _reference(model: Path, layer_ids: list[int]) -> tuple[dict, object]:
    body = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    expected = {}
    for row in map(json.loads, sample_dataset().read_text().splitlines()):
        messages = _messages(row)
        ids = list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
        with torch.no_grad():
            out = body(input_ids=torch.tensor([ids]), output_hidden_states=True)
        expected[str(row["id"])] = {
            "input_ids": ids,
            "assistant_text": "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant"),
            "hidden_states": torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1),
            "final": out.hidden_states[-1][0],
        }
    return expected, (body, tok)


# Both test modules import these fixtures, which makes pytest register them twice: build each run once.
_BUILT: dict[str, RefRun] = {}


@pytest.fixture(scope="session")
def dflash_run(redis_server, tiny_model, tmp_path_factory) -> RefRun:
    if "dflash" in _BUILT:
        return _BUILT["dflash"]
    root = tmp_path_factory.mktemp("reader-dflash")
    run_pipeline(redis_server.url, tiny_model, str(root / "store"), root / "spool", run="rdflash")
    manifest = json.loads((root / "store" / "rdflash" / "manifest.json").read_text())
    expected, hf = _reference(tiny_model, manifest["layer_ids"])
    return _BUILT.setdefault("dflash", RefRun(root / "store", "rdflash", tiny_model, manifest["layer_ids"], expected, hf))


@pytest.fixture(scope="session")
def eagle3_run(redis_server, tmp_path_factory, tiny8_model) -> RefRun:
    if "eagle3" in _BUILT:
        return _BUILT["eagle3"]
    root = tmp_path_factory.mktemp("reader-eagle3")
    model = tiny8_model
    run_pipeline(redis_server.url, model, str(root / "store"), root / "spool", run="reagle3", layers="eagle3")
    manifest = json.loads((root / "store" / "reagle3" / "manifest.json").read_text())
    assert manifest["store_final"] and manifest["layer_ids"] == [1, 3, 4]
    expected, hf = _reference(model, manifest["layer_ids"])
    return _BUILT.setdefault("eagle3", RefRun(root / "store", "reagle3", model, manifest["layer_ids"], expected, hf))


TOL = dict(atol=1e-5, rtol=1e-4)  # float32 runs


def assert_sample_matches(run: RefRun, sample_id: str, input_ids, loss_mask, hidden_states, final=None):
    """One sample read back equals the HF reference: ids, assistant-only mask, hidden states (and final)."""
    want = run.expected[sample_id]
    ids = [int(x) for x in input_ids]
    assert ids == want["input_ids"], sample_id
    tok = run.hf[1]
    mask = torch.as_tensor(loss_mask).bool()
    assert tok.decode(torch.tensor(ids)[mask].tolist()) == want["assistant_text"], sample_id
    torch.testing.assert_close(torch.as_tensor(hidden_states).float(), want["hidden_states"], **TOL)
    if final is not None:
        torch.testing.assert_close(torch.as_tensor(final).float(), want["final"], **TOL)
