"""Glaive function calling v2's raw rows, read as they ship: a ``system`` string and a ``chat`` string.

    system: "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -
             {"name": "get_weather", "description": ..., "parameters": {...}}

             {"name": ..., ...}"                       (one JSON object a function; none: no tools)
    chat:   "USER: What is the weather in Paris?

             ASSISTANT: <functioncall> {"name": "get_weather", "arguments": '{"city": "Paris"}'} <|endoftext|>

             FUNCTION RESPONSE: {"temperature": 21}

             ASSISTANT: It is 21 degrees in Paris. <|endoftext|>"

become OpenAI messages: a system turn (the text before the function list), user turns, assistant turns (text
before ``<functioncall>`` as content, the call as ``tool_calls``; the ``<|endoftext|>`` that closes a turn
dropped: the target's template writes its own end of turn), ``tool`` turns, and the functions as ``tools``.
The call's ``arguments`` are JSON text in single quotes as Glaive writes them (kept as that text), or a JSON
object.
A row that does not read so is rejected: ``glaive_malformed`` (the chat's turns), ``tools_not_list`` (the
function list is not JSON objects), ``tool_args_not_json`` (a call that is not JSON).
"""

from __future__ import annotations

import json
import re
from typing import Any

from hsx.prep.rejected import RowRejected

TURN = re.compile(r"(?:^|\n)[ \t]*(USER|ASSISTANT|FUNCTION RESPONSE|SYSTEM):[ \t]?")
ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
END = "<|endoftext|>"
CALL = "<functioncall>"
# {"name": "x", "arguments": '{...}'}: Glaive's arguments are JSON text in single quotes (not JSON itself)
QUOTED_ARGS = re.compile(r"""^\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*'(?P<args>.*)'\s*\}$""", re.S)


def is_glaive(data: dict[str, Any]) -> bool:
    """A Glaive v2 row: a ``chat`` string (and no messages / conversations, which are read first)."""
    return isinstance(data.get("chat"), str)


def _functions(system: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(the system text before the function list, the functions as tool definitions or None)."""
    text = system.strip().removeprefix("SYSTEM:").strip()
    start = text.find("{")
    if start < 0:
        return text, None
    head, rest = text[:start].rstrip(), text[start:]
    decoder, tools, at = json.JSONDecoder(), [], 0
    while at < len(rest):
        try:
            obj, end = decoder.raw_decode(rest, at)
        except ValueError as exc:
            raise RowRejected("tools_not_list", f"system: the function list is not JSON objects ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise RowRejected("tools_not_list", f"system: function {len(tools)} is not an object with a name")
        tools.append({"type": "function", "function": obj})
        at = end
        while at < len(rest) and rest[at].isspace():
            at += 1
    return head.removesuffix("-").rstrip(), tools


def _call(turn: int, text: str) -> dict[str, Any]:
    where = f"turn {turn} function call"
    text = text.strip()
    try:
        call = json.loads(text)
        args = call.get("arguments", {}) if isinstance(call, dict) else None
    except ValueError:
        quoted = QUOTED_ARGS.match(text)
        if quoted is None:
            raise RowRejected("tool_args_not_json", f"{where} is not JSON: {text[:80]!r}") from None
        call, args = {"name": quoted["name"]}, quoted["args"]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise RowRejected("tool_call_malformed", f"{where} has no function name: {text[:80]!r}")
    try:     # JSON text stays as given (the bytes a serving stack sends), once it is known to hold an object
        decoded = json.loads(args) if isinstance(args, str) and args.strip() else args if args != "" else {}
    except ValueError:
        raise RowRejected("tool_args_not_json", f"{where}: arguments are not JSON: {args[:80]!r}") from None
    if not isinstance(decoded, dict):
        raise RowRejected("tool_args_not_json", f"{where}: arguments are not a JSON object: {args!r:.80}")
    return {"type": "function", "function": {"name": call["name"], "arguments": args}}


def glaive_messages(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(OpenAI messages, tools) of a Glaive v2 row; RowRejected naming the turn when it does not read."""
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise RowRejected("glaive_malformed", f"system is a {type(system).__name__}, not a string")
    head, tools = _functions(system or "")
    chat = data["chat"]
    marks = list(TURN.finditer(chat))
    if not marks or chat[:marks[0].start()].strip():
        raise RowRejected("glaive_malformed", f"chat does not start with a USER:/ASSISTANT: turn: {chat[:60]!r}")
    messages: list[dict[str, Any]] = [{"role": "system", "content": head}] if head else []
    for turn, (mark, after) in enumerate(zip(marks, marks[1:] + [None], strict=True)):
        body = chat[mark.end():after.start() if after else len(chat)].strip()
        body = body.removesuffix(END).rstrip()
        if mark[1] == "SYSTEM":
            raise RowRejected("glaive_malformed", f"turn {turn}: a SYSTEM: turn inside the chat")
        role = ROLES[mark[1]]
        if role == "assistant" and CALL in body:
            content, _, call = body.partition(CALL)
            messages.append({"role": "assistant", "content": content.strip() or None,
                             "tool_calls": [_call(turn, call.removesuffix(END))]})
        elif END in body:
            raise RowRejected("glaive_malformed", f"turn {turn}: {END} inside a turn")
        else:
            messages.append({"role": role, "content": body})
    return messages, tools
