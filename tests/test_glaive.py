"""Glaive function calling v2's raw rows (a `system` string with the function list, a `chat` string of turns) are
read as they ship: OpenAI messages with tools, tool calls and tool results; bad rows rejected with a reason.
The rows are written here from the format's description (no download)."""

import json

import numpy as np
import pytest

from hsx.prep.rows import RowRejected, read_conversation
from hsx.prep.tokenise import ChatTokeniser
from hsx_tools.tinymodel import build_tokenizer

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
NEWS = {"name": "get_news", "description": "Headlines", "parameters": {"type": "object", "properties": {}}}
SYSTEM = ("SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
          + json.dumps(WEATHER, indent=4) + "\n\n" + json.dumps(NEWS, indent=4))
CHAT = ("USER: What is the weather in Paris?\n\n\n"
        "ASSISTANT: <functioncall> {\"name\": \"get_weather\", \"arguments\": '{\"city\": \"Paris\"}'} <|endoftext|>\n\n\n"
        "FUNCTION RESPONSE: {\"temperature\": 21, \"sky\": \"clear\"}\n\n\n"
        "ASSISTANT: It is 21 degrees and clear in Paris. <|endoftext|>\n\n\n"
        "USER: Thanks!\n\n\n"
        "ASSISTANT: You're welcome. <|endoftext|>\n")
GOOD = {"system": SYSTEM, "chat": CHAT}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return ChatTokeniser(build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_a_glaive_row_becomes_messages_with_tools_calls_and_results():
    conv = read_conversation(GOOD)
    assert conv.source_format == "glaive"
    assert conv.tools == [{"type": "function", "function": WEATHER}, {"type": "function", "function": NEWS}]
    assert conv.messages == [
        {"role": "system", "content": "You are a helpful assistant with access to the following functions. "
                                      "Use them if required"},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}', "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."},
    ]


def test_no_functions_and_text_before_a_call():
    row = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
           "chat": "USER: hi\n\nASSISTANT: Let me look. <functioncall> {\"name\": \"f\", \"arguments\": {\"a\": 1}}"
                   " <|endoftext|>\n\nFUNCTION RESPONSE: {}\n\nASSISTANT: done <|endoftext|>"}
    conv = read_conversation(row)
    assert conv.tools is None
    assert conv.messages[0] == {"role": "system",
                                "content": "You are a helpful assistant, with no access to external functions."}
    assert conv.messages[2] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}


@pytest.mark.parametrize("row, code, words", [
    ({"system": SYSTEM, "chat": "USER: x\n\nASSISTANT: <functioncall> {\"name\": \"get_weather\", \"arguments\": "
                                "'{city: Paris}'} <|endoftext|>"}, "tool_args_not_json", "arguments are not JSON"),
    ({"system": SYSTEM, "chat": "USER: x\n\nASSISTANT: <functioncall> get_weather(Paris) <|endoftext|>"},
     "tool_args_not_json", "function call is not JSON"),
    ({"system": SYSTEM, "chat": "hello\nUSER: x\n\nASSISTANT: y"}, "glaive_malformed", "does not start with"),
    ({"system": "SYSTEM: functions -\n{\"name\": \"f\", ", "chat": "USER: x\n\nASSISTANT: y"}, "tools_not_list",
     "function list is not JSON"),
    ({"system": SYSTEM, "chat": "USER: x"}, "no_assistant", "no assistant turn"),
    ({"system": SYSTEM, "chat": "FUNCTION RESPONSE: {}\n\nASSISTANT: y"}, "tool_without_call", "no assistant tool"),
    ({"system": 5, "chat": "USER: x\n\nASSISTANT: y"}, "glaive_malformed", "not a string"),
])
def test_bad_glaive_rows_are_rejected_with_a_reason(row, code, words):
    with pytest.raises(RowRejected, match=words) as err:
        read_conversation(row)
    assert err.value.reason == code


def test_the_tokeniser_masks_the_call_and_the_answers_not_the_tool_result(chat):
    t = chat.encode_row(GOOD, 0)
    assert t.source_format == "glaive" and t.sample_id == "0"
    masked = chat.tok.decode(np.asarray(t.input_ids)[np.asarray(t.loss_mask, bool)].tolist())
    assert "get_weather" in masked and "Paris" in masked and "21 degrees" in masked and "welcome" in masked
    assert "temperature" not in masked and "What is the weather" not in masked
    text = chat.tok.decode(t.input_ids)
    assert "<|endoftext|>" not in text and "Current weather of a city" in text   # the tools list reached the template
