"""Deterministic synthetic rows: plain chat and agentic (reasoning, tool calls, tool results).

Used by scripts/make_sample_data.py (the shipped sample sets) and the tests. Agentic rows come in every
input form hsx reads: OpenAI ``messages`` (arguments as objects or JSON strings, content as strings or
text parts, tool results with and without ``name``) and ShareGPT ``conversations`` with
``function_call`` / ``observation`` turns and ``system`` / ``tools`` columns. Every reasoning text and
every tool call carries a unique tag (``r<row>-<n>``) so a test can find where it was rendered.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = ("the a model token layer hidden state draft target speculative decoding batch queue worker "
         "upload store ledger redis python tensor gradient attention head residual norm weight shard "
         "question answer explain why how what when where because therefore however example code "
         "function value list number sum loop return print data file read write fast slow memory").split()

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite, or some tests.",
     "parameters": {"type": "object", "properties": {"select": {"type": "string"},
                                                     "verbose": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the code for a text.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def chat_messages(rng: random.Random) -> list[dict[str, str]]:
    """1-3 plain user/assistant exchanges, lognormal lengths, sometimes a system turn."""
    turns = rng.choice([1, 1, 2, 3])
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": "You are a helpful assistant."})
    for _ in range(turns):
        msgs.append({"role": "user", "content": sentence(rng, max(3, int(rng.lognormvariate(2.5, 0.6))))})
        msgs.append({"role": "assistant", "content": sentence(rng, max(3, int(rng.lognormvariate(3.6, 0.8))))})
    return msgs


class _Tags:
    def __init__(self, row: int):
        self.row, self.n = row, 0

    def __call__(self) -> str:
        self.n += 1
        return f"r{self.row}-{self.n}"


def _arguments(rng: random.Random, name: str, tag: str) -> dict[str, Any]:
    base = {"read_file": {"path": f"src/{rng.choice(WORDS)}_{tag}.py"},
            "run_tests": {"select": f"tests/test_{rng.choice(WORDS)}.py::{tag}", "verbose": rng.random() < 0.5},
            "search": {"query": f"{rng.choice(WORDS)} {tag}", "limit": rng.randint(1, 20)},
            "get_weather": {"city": f"Paris {tag}"}}
    return base[name]


def _result(rng: random.Random, name: str) -> str:
    if name == "read_file":
        return f"def {rng.choice(WORDS)}(x):\n    return x + {rng.randint(0, 9)}\n"
    return json.dumps({"ok": rng.random() < 0.8, "output": sentence(rng, rng.randint(3, 20))})


def agentic_messages(rng: random.Random, row: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(OpenAI messages, the tools they use): 1-3 user turns, each answered by 0-3 tool rounds (1-3
    calls each, their results consecutive) and a final answer; reasoning on most assistant turns."""
    tag, msgs = _Tags(row), []
    tools = rng.sample(TOOLS, rng.randint(1, len(TOOLS)))
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": "You are a coding agent. " + sentence(rng, rng.randint(3, 12))})
    for _ in range(rng.choice([1, 1, 2, 3])):
        msgs.append({"role": "user", "content": sentence(rng, rng.randint(4, 30))})
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            calls = []
            for _ in range(rng.choice([1, 1, 2, 3])):
                name, call_tag = rng.choice(tools)["function"]["name"], tag()
                args = _arguments(rng, name, call_tag)
                calls.append({"id": f"call_{call_tag}", "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args) if rng.random() < 0.5 else args}})
            step: dict[str, Any] = {"role": "assistant", "tool_calls": calls,
                                    "content": rng.choice([None, "", sentence(rng, rng.randint(3, 15))])}
            if rng.random() < 0.7:
                step["reasoning_content"] = rng.choice(["", "\n"]) + f"Think {tag()}: " + sentence(rng, rng.randint(5, 40))
            msgs.append(step)
            for call in calls:
                result = {"role": "tool", "tool_call_id": call["id"], "content": _result(rng, call["function"]["name"])}
                if rng.random() < 0.5:
                    result["name"] = call["function"]["name"]
                if rng.random() < 0.2:
                    result["content"] = [{"type": "text", "text": result["content"]}]
                msgs.append(result)
        answer: dict[str, Any] = {"role": "assistant", "content": rng.choice(["", "\n"]) + sentence(rng, rng.randint(5, 60))}
        if rng.random() < 0.8:
            answer["reasoning_content"] = f"Think {tag()}: " + sentence(rng, rng.randint(5, 40)) + rng.choice(["", "\n"])
        msgs.append(answer)
    return msgs, tools


def to_sharegpt(msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The same conversation as ShareGPT with function_call / observation turns (reasoning is dropped)."""
    turns, row = [], {}
    for m in msgs:
        if m["role"] == "system":
            row["system"] = m["content"]
        elif m["role"] == "user":
            turns.append({"from": "human", "value": m["content"]})
        elif m["role"] == "tool":
            text = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
            turns.append({"from": "observation", "value": text})
        else:
            if m.get("content"):
                turns.append({"from": "gpt", "value": m["content"]})
            if m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]
                          if isinstance(c["function"]["arguments"], dict) else json.loads(c["function"]["arguments"])}
                         for c in m["tool_calls"]]
                turns.append({"from": "function_call", "value": json.dumps(calls[0] if len(calls) == 1 else calls)})
    row["conversations"] = turns
    if tools:
        row["tools"] = json.dumps(tools)
    return row


def agentic_rows(count: int, seed: int = 7, sharegpt_every: int = 4, no_tools_every: int = 5) -> list[dict[str, Any]]:
    """``count`` agentic rows with ids ``agent-NNNN``: every ``sharegpt_every``-th as ShareGPT, every
    ``no_tools_every``-th without a tools list."""
    rng, rows = random.Random(seed), []
    for i in range(count):
        msgs, tools = agentic_messages(rng, i)
        tools = None if i % no_tools_every == no_tools_every - 1 else tools
        if i % sharegpt_every == sharegpt_every - 1:
            row = to_sharegpt(msgs, tools)
        else:
            row = {"messages": msgs}
            if tools:
                row["tools"] = tools
        rows.append({"id": f"agent-{i:04d}", **row})
    return rows
