"""Row formats: what a dataset row holds, and the (messages, tools) the chat template receives.

A row is one of (first match wins):
  pretokenised  ``input_ids`` + ``loss_mask``: used as given.
  instruction   columns named by a ColumnMapping (``--columns``) or one of INSTRUCTION_PRESETS.
  openai        ``messages``: role system|developer|user|assistant|tool|function; ``content`` a string,
                null, or a list of text parts; assistant ``reasoning_content`` (or ``reasoning`` /
                ``thinking``), ``tool_calls`` (or legacy ``function_call``); tool ``tool_call_id``, ``name``.
  sharegpt      ``conversations``: from human|user|gpt|assistant|model|system|function_call|observation|
                tool, text in ``value``; optional ``system`` column.
  glaive        ``chat`` (a string of USER: / ASSISTANT: / <functioncall> / FUNCTION RESPONSE: turns) and
                ``system`` (with the function list): Glaive function calling v2 as it ships (hsx/prep/glaive.py).
Any format may carry ``tools`` (a list, or a JSON string of one); ``messages`` / ``conversations`` may
also be a JSON string of the list.

Normal form handed to ``apply_chat_template`` (the dict form Hugging Face templates expect):
  {"role": "system"|"user"|"tool", "content": str [, "tool_call_id": str, "name": str]}
  {"role": "assistant", "content": str (None: a call turn given without one) [, "reasoning_content": str]
   [, "tool_calls": [{"type": "function", ["id": str,] "function": {"name": str, "arguments": dict | str}}]]}
  tools: None or [{"type": "function", "function": {...}}, ...] (a bare {"name", ...} entry is wrapped).
  Arguments stay as the row gives them: an object, or the JSON text of one, byte for byte (the tokeniser
  parses the text only for a template that needs an object: hsx/prep/tokenise.py). A content
  given as text parts reaches a template that renders parts as given (``given_parts``; Llama-4-like
  templates trim each part, which the joined string would not show).
A row that cannot be used raises RowRejected with a stable reason code and a message naming the turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hsx.prep.columns import ColumnMapping, preset_for
from hsx.prep.glaive import glaive_messages
from hsx.prep.rejected import RowRejected

OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
                  "tool_response": "tool"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    source_format: str          # openai | sharegpt | instruction


def _text(where: str, value: Any) -> str:
    """A message's content as one string: a string, null (""), or text parts joined without separator."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RowRejected("bad_content", f"{where}: content part of type {kind!r} is not text")
        return "".join(parts)
    raise RowRejected("bad_content", f"{where} has no text content (a {type(value).__name__}, "
                                    "not a string or a list of text parts)")


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise RowRejected("tool_call_malformed", f"{where}: not an object")
    fn = call["function"] if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RowRejected("tool_call_malformed", f"{where}: no function name")
    args = fn.get("arguments", fn.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str) and not args.strip():
        args = {}
    try:     # a string stays as given (what the serving stack sends); it must hold a JSON object
        decoded = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise RowRejected("tool_args_not_json", f"{where} ({name}): arguments are not JSON: {args[:80]!r}") from None
    if not isinstance(decoded, dict):
        raise RowRejected("tool_args_not_json", f"{where} ({name}): arguments are a JSON {type(decoded).__name__}, "
                                                "not an object")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def normalise_tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowRejected("tools_not_list", f"tools is a string that is not JSON: {value[:80]!r}") from None
    if not isinstance(value, list):
        raise RowRejected("tools_not_list", f"tools is a {type(value).__name__}, not a list")
    tools = []
    for k, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise RowRejected("tools_not_list", f"tools[{k}] is a {type(tool).__name__}, not an object")
        tools.append(tool if "type" in tool or "function" in tool else {"type": "function", "function": tool})
    return tools or None


def _openai_message(turn: int, msg: Any) -> dict[str, Any]:
    where = f"turn {turn}"
    if not isinstance(msg, dict):
        raise RowRejected("not_an_object", f"{where} is not an object")
    role = OPENAI_ROLES.get(msg.get("role"))
    if role is None:
        raise RowRejected("unknown_role", f"{where} has unknown role {msg.get('role')!r} (known: {sorted(OPENAI_ROLES)})")
    out: dict[str, Any] = {"role": role, "content": _text(where, msg.get("content"))}
    if role == "assistant":
        reasoning = next((msg[k] for k in REASONING_KEYS if msg.get(k)), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise RowRejected("bad_content", f"{where}: reasoning is a {type(reasoning).__name__}, not a string")
            out["reasoning_content"] = reasoning
        calls = msg.get("tool_calls") or ([msg["function_call"]] if msg.get("function_call") else [])
        if not isinstance(calls, list):
            raise RowRejected("tool_call_malformed", f"{where}: tool_calls is not a list")
        if calls:
            out["tool_calls"] = [_tool_call(f"{where} tool call {j}", c) for j, c in enumerate(calls)]
            if msg.get("content") is None:
                out["content"] = None       # as given: a template may branch on a call turn's null content
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                out[key] = str(msg[key])
    return out


def _sharegpt_messages(raw: list, system: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if isinstance(system, str) and system.strip() and not (raw and isinstance(raw[0], dict)
                                                             and raw[0].get("from") == "system"):
        messages.append({"role": "system", "content": system})
    for turn, msg in enumerate(raw):
        where = f"turn {turn}"
        if not isinstance(msg, dict):
            raise RowRejected("not_an_object", f"{where} is not an object")
        sender = msg.get("from", msg.get("role"))
        role = SHAREGPT_ROLES.get(sender)
        if role is None:
            raise RowRejected("unknown_role", f"{where} has unknown role {sender!r} (known: {sorted(SHAREGPT_ROLES)})")
        value = msg.get("value", msg.get("content"))
        if sender != "function_call":
            messages.append({"role": role, "content": _text(where, value)})
            continue
        try:   # function_call: {"name", "arguments"} or a list of them, as JSON text or already decoded
            calls = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            raise RowRejected("tool_args_not_json", f"{where}: function_call value is not JSON: {value[:80]!r}") from None
        calls = [_tool_call(f"{where} tool call {j}", c) for j, c in enumerate(calls if isinstance(calls, list) else [calls])]
        prev = messages[-1] if messages else None
        if prev is not None and prev["role"] == "assistant" and "tool_calls" not in prev:
            prev["tool_calls"] = calls          # "gpt" text then "function_call": one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    return messages


def _instruction_messages(data: dict[str, Any], mapping: ColumnMapping) -> list[dict[str, Any]]:
    def joined(columns: tuple[str, ...], role: str) -> str:
        parts = []
        for col in columns:
            value = data.get(col)
            if value is None:
                continue
            if not isinstance(value, str):
                raise RowRejected("bad_content", f"column {col!r} ({role}) is a {type(value).__name__}, not a string")
            if value.strip():
                parts.append(value)
        return "\n\n".join(parts)

    if mapping.user and all(data.get(col) is None for col in mapping.user):
        # a typo in --columns: every prompt would be empty, each answer trained as if nothing had been asked
        raise RowRejected("missing_column", f"none of the user columns ({'+'.join(mapping.user)}) is in this row; "
                          f"its columns: {', '.join(sorted(map(str, data))[:12])}")
    messages = []
    if system := joined(mapping.system, "system"):
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": joined(mapping.user, "user")})
    answer: dict[str, Any] = {"role": "assistant", "content": joined(mapping.assistant, "assistant")}
    if reasoning := joined(mapping.reasoning, "reasoning"):
        answer["reasoning_content"] = reasoning
    messages.append(answer)
    return messages


def _check(messages: list[dict[str, Any]]) -> None:
    """Turn-order rules every template relies on; fills a tool result's missing name from its call."""
    calls: list[dict[str, Any]] = []     # the tool calls of the assistant turn the current tool results answer
    answered = 0
    for turn, msg in enumerate(messages):
        role = msg["role"]
        if role == "assistant":
            if not (msg["content"] or "").strip() and not msg.get("tool_calls"):
                raise RowRejected("empty_assistant", f"turn {turn}: assistant turn with neither content nor tool calls")
            calls, answered = msg.get("tool_calls", []), 0
        elif role == "tool":
            if not calls:
                raise RowRejected("tool_without_call", f"turn {turn}: tool result with no assistant tool call before it")
            if "name" not in msg:
                by_id = [c for c in calls if msg.get("tool_call_id") is not None and c.get("id") == msg["tool_call_id"]]
                call = by_id[0] if by_id else calls[min(answered, len(calls) - 1)]
                msg["name"] = call["function"]["name"]
            answered += 1
        else:
            calls = []
    if not any(m["role"] == "assistant" for m in messages):
        raise RowRejected("no_assistant", "no assistant turn: nothing to learn from")


def _turn_list(data: dict[str, Any], column: str) -> list:
    """The column's list of turns (a JSON string of one is decoded)."""
    raw = data[column]
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raise RowRejected("empty_conversation", f"{column!r} is a string that is not JSON") from None
    if not isinstance(raw, list) or not raw:
        raise RowRejected("empty_conversation", f"{column!r} is empty or not a list")
    return raw


def read_conversation(data: dict[str, Any], mapping: ColumnMapping | None = None) -> Conversation:
    """The row as (messages, tools) in normal form; RowRejected when it cannot be used."""
    mapping = mapping or ColumnMapping()
    if mapping.user or mapping.assistant:
        messages, fmt = _instruction_messages(data, mapping), "instruction"
    elif data.get(mapping.messages) is not None:
        raw = _turn_list(data, mapping.messages)
        messages, fmt = [_openai_message(t, m) for t, m in enumerate(raw)], "openai"
    elif data.get(mapping.conversations) is not None:
        raw = _turn_list(data, mapping.conversations)
        system = data.get(mapping.system[0]) if mapping.system else data.get("system")
        messages, fmt = _sharegpt_messages(raw, system), "sharegpt"
    elif isinstance(data.get("chat"), str):   # Glaive function calling v2 as it ships: system + chat strings

        raw, tools = glaive_messages(data)
        messages = [_openai_message(t, m) for t, m in enumerate(raw)]
        _check(messages)
        return Conversation(messages, normalise_tools(tools), "glaive")
    else:
        preset = preset_for(data)
        if preset is None:
            raise RowRejected("no_conversation", "no 'messages', 'conversations' or 'input_ids' field, nor instruction "
                                                 f"columns (columns: {sorted(data)[:12]}); map them with --columns")
        messages, fmt = _instruction_messages(data, preset), "instruction"
    _check(messages)
    return Conversation(messages, normalise_tools(data.get(mapping.tools)), fmt)


def given_parts(messages: list[dict[str, Any]], raw) -> list[dict[str, Any]]:
    """The normal form with each content that the row gives as text parts given so (the marked copy marks
    each part's text). Rows in ``messages`` form map one message to one."""
    if isinstance(raw, str):
        raw = json.loads(raw)
    out = []
    for msg, given in zip(messages, raw, strict=True):
        parts = given.get("content") if isinstance(given, dict) else None
        if (isinstance(parts, list) and parts
                and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts)):
            msg = {**msg, "content": parts}
        out.append(msg)
    return out
