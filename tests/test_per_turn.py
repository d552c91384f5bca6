"""`--per-turn` (issue 40 item 5): one sample per assistant turn, as the template renders history
(hsx/prep/perturn.py). For template families that drop earlier turns' reasoning (the tiny model's ChatML,
Qwen-like think_last_turns, reasoning on the last message only) and one that keeps it (text_arguments), all with
tool calls, on generated agentic rows:
- each sample's ids are apply_chat_template of the conversation cut after its turn, the turns being what the
  family's own rule says (an independent oracle per family, not hsx's prefix test);
- its mask is the template's {% generation %} blocks of that turn's assistant messages only;
- every assistant message's reasoning is in exactly one sample's mask (the whole row misses those the template drops);
- ids ``<row id>#t<j>`` are stable across tokenisers and distinct; a one-turn row is today's row, id aside;
- a row without an assistant turn is rejected as today; the producer records per_turn and refuses a resume without it;
- windows count rows in and samples out, a duplicated row id once; `hsx inspect --per-turn` prints both, the tokens
  against the whole rows', and says when every row is one turn;
- every family of test_mask_families: each sample is the rendering of a cut conversation (found by trying every
  cut), its mask the generation blocks since the previous cut: every assistant message trained once.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from hsx.prep import TokeniseSettings, WindowTokeniser
from hsx.prep.perturn import split_turn_id, turn_id
from hsx.prep.rows import RowRejected, read_conversation
from hsx.prep.tokenise import ChatTokeniser
from hsx_tools.demo import sample_dataset
from hsx_tools.samples import agentic_rows
from hsx_tools.tinymodel import CHAT_TEMPLATE, build_tokenizer
from tests.pipeline import planned_specs
from tests.test_mask_families import FAMILIES, REFUSED_BY_TEMPLATE, TEMPLATES, _as_given

ROWS = 24
AGENTIC = Path(sample_dataset()).with_name("sample_agentic.jsonl")


def _user_before_next_assistant(messages, i) -> bool:
    later = [m["role"] for m in messages[i + 1:]]
    upto = later.index("assistant") if "assistant" in later else len(later)
    return "user" in later[:upto]


def _block_has_reasoning(messages, i) -> bool:
    """An assistant message with reasoning since the last user message before message i (i included)."""
    start = max((k for k in range(i) if messages[k]["role"] == "user"), default=-1) + 1
    return any(m["role"] == "assistant" and (m.get("reasoning_content") or "").strip() for m in messages[start:i + 1])


# Where each family's turns end, from what its template does (the last assistant message always ends one):
ENDS = {
    # reasoning shown after the last user message only: a turn ends before a user message, if it had any to drop
    "chatml_thinking_tools": lambda ms, i: _user_before_next_assistant(ms, i) and _block_has_reasoning(ms, i),
    # a reasoning block (empty or not) opened on every turn after the last real user message
    "think_last_turns": _user_before_next_assistant,
    # reasoning rendered on the conversation's last message only
    "think_final_only": lambda ms, i: bool((ms[i].get("reasoning_content") or "").strip()),
    # reasoning rendered everywhere: one turn, the whole conversation
    "text_arguments": lambda ms, i: False,
}
SETUP = {   # family -> (template, special tokens, bos, eos, row transform, arguments as _as_given takes them)
    "chatml_thinking_tools": (CHAT_TEMPLATE, (), None, "<|im_end|>", None, "object"),
    "think_last_turns": ((TEMPLATES / "think_last_turns.jinja").read_text(), (), None, "<|im_end|>", None, "object"),
    **{name: ((TEMPLATES / FAMILIES[name][0]).read_text(), FAMILIES[name][1], FAMILIES[name][2], FAMILIES[name][5],
              FAMILIES[name][3], FAMILIES[name][4]) for name in ("think_final_only", "text_arguments")},
}


def _tokeniser(name, path):
    template, special, bos, eos, _, _ = SETUP[name]
    tok = build_tokenizer(path, chat_template=template, special_tokens=special, bos_token=bos, eos_token=eos,
                          sample_path=sample_dataset())
    return tok, ChatTokeniser(tok)


def _rows(name):
    transform = SETUP[name][4]
    return [transform(r) if transform else r for r in agentic_rows(ROWS, seed=31)]


def _runs(mask) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(mask, np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def _reasonings(messages) -> list[str]:
    return [m["reasoning_content"].strip() for m in messages
            if m["role"] == "assistant" and (m.get("reasoning_content") or "").strip()]


def _trained(tok, ids, mask, reasonings) -> set[str]:
    text = tok.decode(np.asarray(ids)[np.asarray(mask) == 1].tolist())
    return {r for r in reasonings if r in text}


@pytest.mark.parametrize("name", sorted(SETUP))
def test_each_turn_is_the_template_rendering_cut_after_it_its_mask_that_turn(name, tmp_path):
    tok, chat = _tokeniser(name, tmp_path)
    arguments = SETUP[name][5]
    samples_made = reasoning_rows = whole_trained = every = 0
    for index, row in enumerate(_rows(name)):
        conv = read_conversation(row)
        given = _as_given(row, [{**m, "content": m["content"] or ""} for m in conv.messages], arguments)
        assistants = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        ends = [i for i in assistants[:-1] if ENDS[name](conv.messages, i)] + assistants[-1:]
        got = chat.encode_turns(row, index)
        assert [s.sample_id for s in got] == [f"{row['id']}#t{j}" for j in range(len(ends))], row["id"]
        reasonings = _reasonings(conv.messages)
        trained: list[str] = []
        start = 0
        for sample, end in zip(got, ends, strict=True):
            want = tok.apply_chat_template(given[:end + 1], tools=conv.tools, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
            assert sample.input_ids.tolist() == list(want["input_ids"]), (row["id"], sample.sample_id)
            runs = _runs(want["assistant_masks"])     # one generation block an assistant message, in order
            mine = [k for k, i in enumerate(i for i in assistants if i <= end) if i >= start]
            assert len(runs) == len([i for i in assistants if i <= end]), (row["id"], sample.sample_id)
            expected = np.zeros(len(sample.input_ids), np.uint8)
            for k in mine:
                expected[runs[k][0]:runs[k][1]] = 1
            assert sample.loss_mask.tolist() == expected.tolist(), (row["id"], sample.sample_id)
            trained += sorted(_trained(tok, sample.input_ids, sample.loss_mask, reasonings))
            start = end + 1
        # every reasoning the row holds is trained, once; the last turn's in the last sample
        assert sorted(trained) == sorted(reasonings), row["id"]
        last = _reasonings(conv.messages[assistants[-1]:])
        assert set(last) <= _trained(tok, got[-1].input_ids, got[-1].loss_mask, last), row["id"]
        whole = chat.encode_row(row, index)
        whole_trained += len(_trained(tok, whole.input_ids, whole.loss_mask, reasonings))
        every += len(reasonings)
        reasoning_rows += bool(reasonings)
        samples_made += len(got)
        if len(got) == 1 and conv.messages[-1]["role"] == "assistant":   # one turn: today's row, id aside
            assert (got[0].input_ids.tolist(), got[0].loss_mask.tolist()) == (whole.input_ids.tolist(),
                                                                             whole.loss_mask.tolist())
    print(f"{name}: {ROWS} rows -> {samples_made} samples; reasonings trained {every} per turn, {whole_trained} whole")
    assert reasoning_rows >= ROWS // 2 and every >= ROWS
    if name == "text_arguments":   # keeps history: the expansion adds nothing
        assert samples_made == ROWS and whole_trained == every
    else:
        assert samples_made > ROWS * 1.3 and whole_trained < every * 0.8


def test_a_one_turn_row_is_todays_row_and_a_row_without_an_assistant_is_rejected_alike(tmp_path):
    tok, chat = _tokeniser("think_last_turns", tmp_path)
    one = {"id": "q1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                                    {"role": "assistant", "reasoning_content": "Add them.", "content": "4"}]}
    [sample] = chat.encode_turns(one, 0)
    whole = chat.encode_row(one, 0)
    assert sample.sample_id == "q1#t0" and whole.sample_id == "q1"
    assert sample.input_ids.tolist() == whole.input_ids.tolist() and sample.loss_mask.tolist() == whole.loss_mask.tolist()
    assert "Add them." in tok.decode(sample.input_ids[sample.loss_mask == 1].tolist())
    pretokenised = {"id": "p", "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    assert [s.sample_id for s in chat.encode_turns(pretokenised, 1)] == ["p#t0"]
    for row in ({"id": "n", "messages": [{"role": "user", "content": "hi"}]},
                {"id": "t", "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}):
        reasons = []
        for encode in (chat.encode_row, chat.encode_turns):
            with pytest.raises(RowRejected) as caught:
                encode(row, 2)
            reasons.append((caught.value.reason, str(caught.value)))
        assert reasons[0] == reasons[1], reasons


def test_ids_are_stable_distinct_and_split_back_into_row_and_turn(tmp_path):
    """Two tokenisers give the same samples; ids never collide, even with row ids that look like turn ids."""
    _, first = _tokeniser("chatml_thinking_tools", tmp_path / "a")
    _, second = _tokeniser("chatml_thinking_tools", tmp_path / "b")
    rows = _rows("chatml_thinking_tools")
    for row, fake in zip(rows, ("a", "a#t1", "a#t0#t1", "a#t", "a#t01", "a#tx"), strict=False):
        row["id"] = fake
    ids = []
    for index, row in enumerate(rows):
        one, two = first.encode_turns(row, index), second.encode_turns(row, index)
        assert [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in one] == \
               [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in two]
        ids += [s.sample_id for s in one]
        assert [split_turn_id(s.sample_id) for s in one] == [(str(row["id"]), j) for j in range(len(one))]
    assert len(ids) == len(set(ids)) > len(rows)
    assert turn_id("a#t1", 0) == "a#t1#t0" and split_turn_id("a#t1#t0") == ("a#t1", 0) and split_turn_id("a#tx") is None


def test_windows_count_rows_in_and_samples_out(tiny_model, tmp_path):
    """The shipped agentic rows, and the first again (a duplicate id: rejected once, as a row, not once a turn)."""
    lines = AGENTIC.read_text().splitlines()
    data = tmp_path / "agentic.jsonl"
    data.write_text("\n".join([*lines, lines[0]]) + "\n")
    settings = TokeniseSettings(str(tiny_model), 32768, "drop", {}, None, per_turn=True)
    with WindowTokeniser(data, settings, 1, 15) as windows:
        got = list(windows)
    rows = sum(w.report.turn_rows for w in got)
    samples = [s for w in got for s in w.samples]
    assert rows == 40 and len(samples) == sum(w.report.kept for w in got) > 60
    report = got[-1].report
    assert report.rejected == {"duplicate_sample_id": 1} and report.duplicate_ids == 1 and report.rows == 11
    # a row's samples are adjacent, in turn order, in its window: the planner sees a conversation's turns together
    split = [split_turn_id(s.sample_id) for s in samples]
    for (row, turn), (before, previous) in zip(split[1:], split[:-1], strict=True):
        assert (row, turn) == (before, previous + 1) or (turn == 0 and row != before), (before, previous, row, turn)
    assert len({s.sample_id for s in samples}) == len(samples)


def test_produce_records_per_turn_and_a_resume_without_it_is_refused(r, redis_env, tiny_model, tmp_path, capsys):
    """`hsx produce --per-turn` plans the turns' samples and records per_turn; the same run without the flag is
    refused, naming it; a run without it writes no per_turn (its manifest as before). `hsx run` passes it on."""
    from hsx.runspec import Manifest
    from hsx.store import open_store
    from hsx_cli import produce as produce_cli
    from hsx_cli import run as run_cli
    from hsx_cli.main import main

    data = tmp_path / "agentic.jsonl"
    data.write_text("".join(line + "\n" for line in AGENTIC.read_text().splitlines()[:6]))
    store = tmp_path / "store"
    args = ["produce", "--dataset", str(data), "--model", str(tiny_model), "--store", str(store), "--layers",
            "dflash:3", "--token-budget", "8192", "--max-length", "4096", "--tokenise-workers", "1"]
    assert main([*args, "--run", "turns", "--per-turn"]) == 0
    manifest = Manifest.load(open_store(str(store)), "turns")
    assert manifest.per_turn and json.loads(manifest.to_json())["per_turn"] is True
    planned = [sid for spec in planned_specs(r, "turns").values() for sid in spec.sample_ids]
    assert len(planned) == len(set(planned)) > 6 and {split_turn_id(sid)[0] for sid in planned} == {
        json.loads(line)["id"] for line in data.read_text().splitlines()}
    capsys.readouterr()
    assert main([*args, "--run", "turns"]) == 2
    assert "per_turn: run has True, this call has False" in capsys.readouterr().err
    assert main([*args, "--run", "whole"]) == 0
    assert "per_turn" not in json.loads(Manifest.load(open_store(str(store)), "whole").to_json())
    values = {f.dest: None for f in produce_cli.FLAGS} | {"per_turn": True}
    assert "--per-turn" in {f.name for f in run_cli.FLAGS} and "--per-turn" in run_cli.passed(produce_cli.FLAGS, values, ())


def test_inspect_reports_rows_in_and_out_tokens_and_says_when_the_expansion_adds_nothing(tiny_model, tmp_path, capsys):
    """Agentic rows with reasoning split into turns (the tiny model's template drops reasoning from history);
    the shipped chat rows, without reasoning, render alike in history: one turn a row, and inspect says so."""
    from hsx_tools.inspect import InspectConfig, run_inspect

    agentic, chat = tmp_path / "agentic.jsonl", tmp_path / "chat.jsonl"
    agentic.write_text("\n".join(AGENTIC.read_text().splitlines()[:6]) + "\n")
    chat.write_text("\n".join(sample_dataset().read_text().splitlines()[:6]) + "\n")
    outputs = {}
    for data in (agentic, chat):
        cfg = InspectConfig(dataset=data, model=str(tiny_model), layers="dflash:3", template_kwargs={}, columns=None,
                            max_length=4096, overlong="drop", max_reject_share=0.01, tokenise_workers=1,
                            window_rows=100, token_budget=8192, max_batch_rows=64, pad_multiple=1, dtype="bfloat16",
                            store_dtype=None, codec="none", compute_dtype="bfloat16", fp8_accumulation="fp32",
                            per_turn=True, prefix_reuse="auto", prefix_min_tokens=32, prefix_forward_tokens=64, samples=0,
                            seed=0,
                            sample_chars=100, plain=True, limit_rows=0,
                            gpu_tokens_per_s=None, gpu_usd_per_hour=None, storage_usd_per_tb_month=23.0)
        assert run_inspect(cfg) == 0
        outputs[data.stem] = capsys.readouterr().out
    split = re.search(r"per-turn: 6 rows -> (\d+) samples .*, ([\d,]+) tokens stored against ([\d,]+) for the 6 whole "
                      r"rows \(x([\d.]+), \+([\d,]+)\)", outputs["agentic"])
    assert split, outputs["agentic"]
    samples, stored, whole = int(split.group(1)), int(split.group(2).replace(",", "")), int(split.group(3).replace(",", ""))
    assert samples > 6 and stored > whole and stored - whole == int(split.group(5).replace(",", ""))
    assert "shared prefixes (agentic.jsonl, one sample a turn, ids after the template): " in outputs["agentic"]
    assert f"({samples} rows) lie in a prefix" in outputs["agentic"] and "every row is one turn" not in outputs["agentic"]
    assert "per-turn: 6 rows -> 6 samples" in outputs["chat"] and "(x1.00, +0)" in outputs["chat"]
    assert "every row is one turn here" in outputs["chat"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_each_sample_is_a_cut_conversation_and_every_message_is_trained_once(name, tmp_path):
    """Every held-out family of test_mask_families, 8 agentic rows: each sample's ids are the template's rendering
    of the conversation cut after some assistant message (found by trying each, in order: not by hsx's rule),
    the cuts rise to the last assistant message, and each sample's mask is the generation blocks of the
    assistant messages since the previous cut: every assistant message in exactly one sample's mask."""
    from tests.test_mask_families import family_tokenizer

    template, special, bos, transform, arguments, eos = FAMILIES[name]
    tok = family_tokenizer(name, tmp_path)
    chat = ChatTokeniser(tok)
    stored = refused = 0
    for index, row in enumerate(agentic_rows(8, seed=37)):
        row = transform(row) if transform else row
        conv = read_conversation(row)
        given = _as_given(row, [{**m, "content": m["content"] or ""} for m in conv.messages], arguments)
        assistants = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        try:
            whole = tok.apply_chat_template(given, tools=conv.tools, tokenize=True, return_dict=True)
        except Exception:       # the template refuses the row: so does --per-turn
            with pytest.raises(RowRejected, match="template"):
                chat.encode_turns(row, index)
            refused += 1
            continue
        assert whole
        candidates, start = iter(assistants), 0
        for sample in chat.encode_turns(row, index):
            for end in candidates:
                want = tok.apply_chat_template(given[:end + 1], tools=conv.tools, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
                if list(want["input_ids"]) == sample.input_ids.tolist():
                    break
            else:
                pytest.fail(f"{row['id']} {sample.sample_id}: not the rendering of a cut after an assistant message")
            runs = _runs(want["assistant_masks"])
            before = [i for i in assistants if i <= end]
            assert len(runs) == len(before), (row["id"], sample.sample_id)
            expected = np.zeros(len(sample.input_ids), np.uint8)
            for k, i in enumerate(before):
                if i >= start:
                    expected[runs[k][0]:runs[k][1]] = 1
            assert sample.loss_mask.tolist() == expected.tolist(), (row["id"], sample.sample_id)
            start, stored = end + 1, stored + 1
        assert start == assistants[-1] + 1, row["id"]
    assert bool(refused) == (name in REFUSED_BY_TEMPLATE) and stored >= 8 - refused
