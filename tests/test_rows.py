"""Row formats reach the chat template whole; bad rows get a named reason and good rows are kept."""

import json

import pytest

from hsx.prep.columns import ColumnMapping, ColumnMappingError
from hsx.prep.rows import RowRejected, read_conversation
from hsx.prep.tokenise import ChatTokeniser, parse_template_kwargs
from hsx_tools.tinymodel import build_tokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokeniser(build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_openai_row_keeps_reasoning_tool_calls_tool_fields_and_tools():
    row = {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": None, "reasoning": "look it up", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "found"}]},
        {"role": "assistant", "content": "x is here", "function_call": {"name": "done", "arguments": {"ok": True}}},
    ], "tools": json.dumps([{"name": "search", "parameters": {"type": "object"}}])}
    conv = read_conversation(row)
    assert conv.source_format == "openai"
    assert conv.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": None, "reasoning_content": "look it up",   # null content kept for the template
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "content": "found", "tool_call_id": "c1", "name": "search"},   # name filled from its call
        {"role": "assistant", "content": "x is here",
         "tool_calls": [{"type": "function", "function": {"name": "done", "arguments": {"ok": True}}}]},
    ]
    assert conv.tools == [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


def test_sharegpt_row_with_function_call_observation_system_and_tools_columns():
    row = {"system": "You help.", "tools": '[{"type": "function", "function": {"name": "search"}}]',
           "conversations": [
               {"from": "human", "value": "find x"},
               {"from": "gpt", "value": "Searching."},
               {"from": "function_call", "value": '[{"name": "search", "arguments": {"query": "x"}}, '
                                                  '{"name": "search", "arguments": "{\\"query\\": \\"y\\"}"}]'},
               {"from": "observation", "value": "x found"},
               {"from": "observation", "value": "y found"},
               {"from": "gpt", "value": "Both found."}]}
    conv = read_conversation(row)
    assert conv.source_format == "sharegpt"
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert conv.messages[2]["content"] == "Searching."       # gpt text + function_call: one assistant turn
    # arguments as given: an object, or JSON text kept byte for byte (parsed only for a template that needs it)
    assert [c["function"]["arguments"] for c in conv.messages[2]["tool_calls"]] == [{"query": "x"}, '{"query": "y"}']
    assert conv.messages[3]["name"] == conv.messages[4]["name"] == "search"
    assert conv.tools[0]["function"]["name"] == "search"


@pytest.mark.parametrize("row, mapping, expected", [
    ({"system_prompt": "S", "question": "Q", "response": "A"}, None, [("system", "S"), ("user", "Q"), ("assistant", "A")]),
    ({"instruction": "Do", "input": "this", "output": "Done"}, None, [("user", "Do\n\nthis"), ("assistant", "Done")]),
    ({"instruction": "Do", "input": "", "output": "Done"}, None, [("user", "Do"), ("assistant", "Done")]),
    ({"problem": "1+1", "solution": "2"}, None, [("user", "1+1"), ("assistant", "2")]),
    ({"q": "Why", "ctx": "because", "a": "So", "sys": "Be kind"}, "user=q+ctx,assistant=a,system=sys",
     [("system", "Be kind"), ("user", "Why\n\nbecause"), ("assistant", "So")]),
])
def test_instruction_rows(row, mapping, expected):
    conv = read_conversation(row, ColumnMapping.parse(mapping))
    assert conv.source_format == "instruction"
    assert [(m["role"], m["content"]) for m in conv.messages] == expected


def test_column_mapping_file_renames_and_reasoning(tmp_path):
    spec = tmp_path / "cols.json"
    spec.write_text(json.dumps({"user": "prompt", "assistant": ["answer"], "reasoning": "trace", "id": "uid"}))
    mapping = ColumnMapping.parse(str(spec))
    conv = read_conversation({"prompt": "P", "answer": "A", "trace": "T"}, mapping)
    assert conv.messages[-1] == {"role": "assistant", "content": "A", "reasoning_content": "T"}
    assert mapping.to_dict() == {"id": "uid", "user": ["prompt"], "assistant": ["answer"], "reasoning": ["trace"]}
    renamed = read_conversation({"chat": json.dumps([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}])},
                                ColumnMapping.parse("messages=chat"))     # a JSON string of the turns is decoded
    assert renamed.source_format == "openai"
    for bad in ("user=q", "colour=x", "user", "messages=a+b", str(tmp_path / "missing.json")):
        with pytest.raises(ColumnMappingError):
            ColumnMapping.parse(bad)


def test_the_tokeniser_reads_rows_through_the_column_mapping(chat):
    mapped = ChatTokeniser(chat.tok, columns=ColumnMapping.parse("user=q,assistant=a,id=uid"))
    got = mapped.encode_row({"uid": "u-7", "q": "why", "a": "because"}, 3)
    assert (got.sample_id, got.source_format) == ("u-7", "instruction")
    assert chat.tok.decode(got.input_ids[got.loss_mask.astype(bool)].tolist()) == "because<|im_end|>\n"


def test_a_row_holding_none_of_its_user_columns_is_rejected_by_name_not_trained_on_an_empty_prompt():
    """A typo in --columns (an outside check: user=instrction+input) gave every row an empty user turn, kept."""
    mapping = ColumnMapping.parse("user=instrction+input,assistant=output")
    with pytest.raises(RowRejected, match=r"none of the user columns \(instrction\+input\).*instruction, output") as exc:
        read_conversation({"instruction": "say hi", "output": "hi"}, mapping)
    assert exc.value.reason == "missing_column"
    conv = read_conversation({"instrction": "say hi", "input": "", "output": "hi"}, mapping)   # present, one empty
    assert conv.messages[0] == {"role": "user", "content": "say hi"}
    assert read_conversation({"input": "", "output": "hi"}, mapping).messages[0]["content"] == ""   # present, empty


@pytest.mark.parametrize("value, said", [({"k": 1}, "holds a dict"), ([1], "holds a list"), (True, "holds a bool"),
                                         ("", "is empty"), ("  ", "is empty")])
def test_an_id_that_is_no_string_or_number_or_is_empty_is_rejected_by_name(chat, value, said):
    """It became its Python repr ("{'k': 1}", "True") or an empty id, kept (an outside check)."""
    with pytest.raises(RowRejected, match=said) as exc:
        chat.encode_row({"id": value, "messages": [{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]}, 4)
    assert exc.value.reason == "bad_id"
    for fine, stored in ((7, "7"), (1.5, "1.5"), ("r-1", "r-1"), (None, "4")):
        assert chat.encode_row({"id": fine, "messages": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "a"}]}, 4).sample_id == stored


def test_template_kwargs_parse():
    assert parse_template_kwargs("enable_thinking=false, date_string=01 Jan 2030") == {
        "enable_thinking": False, "date_string": "01 Jan 2030"}
    assert parse_template_kwargs('{"enable_thinking": true}') == {"enable_thinking": True}
    assert parse_template_kwargs(None) == {}
    with pytest.raises(ValueError):
        parse_template_kwargs("enable_thinking")


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello",
                                                          "reasoning_content": "greet", "tool_calls": [CALL]},
                     {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}],
        "tools": [{"type": "function", "function": {"name": "search"}}]}
BAD = [
    ("tool_args_not_json", "turn 1 tool call 0 (search): arguments are not JSON",
     {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
         {"function": {"name": "search", "arguments": "{query: x"}}]}]}),
    ("tool_without_call", "turn 1: tool result with no assistant tool call before it",
     {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                   {"role": "assistant", "content": "a"}]}),
    ("empty_assistant", "turn 1: assistant turn with neither content nor tool calls",
     {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "reasoning_content": "hm"}]}),
    ("unknown_role", "turn 0 has unknown role 'robot'",
     {"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}),
    ("tools_not_list", "tools is a dict, not a list",
     {"messages": GOOD["messages"], "tools": {"name": "search"}}),
    ("no_assistant", "no assistant turn", {"messages": [{"role": "user", "content": "q"}]}),
    ("bad_content", "turn 0: content part of type 'image_url' is not text",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "a"}]}),
    ("tool_call_malformed", "turn 1 tool call 0: no function name",
     {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]}),
]


def test_bad_rows_are_named_and_good_rows_kept(chat):
    rows = [GOOD] + [row for _, _, row in BAD] + [GOOD]
    kept, rejected = [], []
    for index, row in enumerate(rows):
        try:
            kept.append(chat.encode_row(row, index).sample_id)
        except RowRejected as exc:
            rejected.append((exc.reason, str(exc)))
    assert kept == ["0", str(len(rows) - 1)]
    assert [r for r, _ in rejected] == [code for code, _, _ in BAD]
    for (_, message), (_, want, _) in zip(rejected, BAD, strict=False):
        assert want in message


def test_a_turn_the_template_does_not_render_is_rejected_naming_it(tmp_path):
    plain = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    chat = ChatTokeniser(build_tokenizer(tmp_path, chat_template=plain))
    calls_only = {"messages": [GOOD["messages"][0], {"role": "assistant", "content": "", "tool_calls": [CALL]},
                               *GOOD["messages"][2:]]}
    with pytest.raises(RowRejected, match="turn 1 \\(assistant\\): the template does not render it") as exc:
        chat.encode_row(calls_only, 0)   # this template drops tool calls: nothing of turn 1 is left
    assert exc.value.reason == "turn_not_located"
    plain_row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert chat.encode_row(plain_row, 0).loss_mask.sum() > 0


def test_templates_hsx_cannot_follow(tmp_path):
    from hsx.prep.tokenise import TemplateError

    shouting = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
                "{% if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}"
                "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    with pytest.raises(TemplateError, match="does not render message contents verbatim"):
        ChatTokeniser(build_tokenizer(tmp_path / "a", chat_template=shouting))
    # Template text that depends on an answer's length: the marked rendering cannot line up; the row is
    # rejected naming the turn, a row the branch does not touch is kept.
    moody = ("{% if messages | length > 1 and messages[1].content | length > 30 %}{{ 'A long chat.\\n' }}{% endif %}"
             "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    chat = ChatTokeniser(build_tokenizer(tmp_path / "b", chat_template=moody))
    long_answer = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "because " * 5}]}
    with pytest.raises(RowRejected, match="turn 1 \\(assistant\\): the rendering with marked contents") as exc:
        chat.encode_row(long_answer, 0)
    assert exc.value.reason == "turn_not_located"
    assert chat.encode_row({"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "ok"}]}, 1)


def test_bad_json_lines_are_named_with_their_column_once(tmp_path):
    """Issue 41 item 10: json's own "Unterminated string starting at" became "... starting at at column 13"."""
    from hsx.prep.dataset import RowError, iter_rows

    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": "no end\n{"messages": [}\n{\'single\': 1}\n')
    reasons = [row.reason for row in iter_rows(path) if isinstance(row, RowError)]
    assert reasons == ["line 1 of bad.jsonl is not valid JSON: Unterminated string starting at column 14",
                       "line 2 of bad.jsonl is not valid JSON: Expecting value at column 15",
                       "line 3 of bad.jsonl is not valid JSON: Expecting property name enclosed in double quotes "
                       "at column 2"]


def test_a_bad_row_is_a_reject_with_its_reason_and_a_bug_in_the_tokeniser_is_not(chat, monkeypatch):
    """Only a bad row's error (RowRejected) counts as a reject; any other error while tokenising is a bug in hsx
    or a library, and surfaces naming the row instead of being counted under a made-up reason."""
    from hsx.prep import windows
    from hsx.prep.dataset import Row

    monkeypatch.setattr(windows, "_tokeniser", chat)
    monkeypatch.setattr(windows, "_per_turn", False)
    bad_args = {"messages": [{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {
                                 "name": "search", "arguments": "{not json"}}]}]}
    surrogate = {"messages": [{"role": "user", "content": json.loads('"half a pair \\ud800"')},
                              {"role": "assistant", "content": "a"}]}   # JSON text may hold one; no tokenizer takes it
    huge = {"input_ids": [1, 2**70], "loss_mask": [0, 1]}
    for index, (row, code, says) in enumerate([(bad_args, "tool_args_not_json", "arguments are not JSON"),
                                               (surrogate, "bad_content", "not valid Unicode"),
                                               (huge, "bad_pretokenised", "outside the vocabulary")]):
        rejected = windows._encode_one(Row(index, row))
        assert (rejected.code, rejected.index) == (code, index) and says in rejected.message, rejected
    assert windows._encode_one(Row(3, GOOD)).sample_id == "3"   # a good row is encoded

    def broken(text):
        raise ValueError("a bug in the encoder")
    monkeypatch.setattr(chat, "_encode", broken)
    with pytest.raises(RuntimeError, match="row 4 .*not a bad row.*ValueError: a bug in the encoder"):
        windows._encode_one(Row(4, GOOD))
