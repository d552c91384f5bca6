"""Turning a dataset row into (input_ids, loss_mask) with the target's chat template.

The loss mask covers the tokens of assistant turns: for assistant turn k, the
characters between the rendering of turns [0, k) with the generation prompt
and the rendering of turns [0, k] (its content and end-of-turn marker). The
whole conversation is tokenised once; a token is in the mask when its
character span lies inside an assistant span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "system": "system", "tool": "tool"}
CHAT_ROLES = {"system", "user", "assistant", "tool"}


class RowProblem(ValueError):
    """This row cannot be used; the message says why."""


@dataclass(frozen=True)
class Tokenised:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


def normalise_messages(data: dict[str, Any]) -> list[dict[str, str]]:
    if "messages" in data and data["messages"] is not None:
        raw, role_key, text_key, roles = data["messages"], "role", "content", {r: r for r in CHAT_ROLES}
    elif "conversations" in data and data["conversations"] is not None:
        raw, role_key, text_key, roles = data["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise RowProblem("no 'messages', 'conversations' or 'input_ids' field")
    if not isinstance(raw, list) or not raw:
        raise RowProblem("the conversation is empty or not a list")
    messages = []
    for turn, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise RowProblem(f"turn {turn} is not an object")
        role = msg.get(role_key) if role_key in msg else msg.get("role")
        text = msg.get(text_key) if text_key in msg else msg.get("content")
        if role not in roles:
            raise RowProblem(f"turn {turn} has unknown role {role!r} (known: {sorted(roles)})")
        if not isinstance(text, str):
            raise RowProblem(f"turn {turn} has no text content")
        messages.append({"role": roles[role], "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowProblem("no assistant turn: nothing to learn from")
    return messages


class ChatTokeniser:
    """Wraps a Hugging Face fast tokenizer that has a chat template."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; hsx needs one to tokenise chat rows")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("hsx needs a fast tokenizer (character offsets) to build the loss mask")
        self.tok = tokenizer

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        full = self._render(messages, add_generation_prompt=False)
        spans = []
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            before = self._render(messages[:k], add_generation_prompt=True) if k else ""
            upto = self._render(messages[:k + 1], add_generation_prompt=False)
            if not full.startswith(upto) or not upto.startswith(before):
                raise RowProblem(f"the chat template does not render turn {k} as a prefix of the conversation; "
                                 "cannot place the loss mask")
            spans.append((len(before), len(upto)))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = []
        for start, end in enc["offset_mapping"]:
            mask.append(int(any(a <= start and end <= b and end > start for a, b in spans)))
        return list(enc["input_ids"]), mask

    def encode_row(self, data: dict[str, Any], index: int) -> Tokenised:
        sample_id = str(data["id"]) if data.get("id") is not None else str(index)
        if data.get("input_ids") is not None:
            ids, mask = data["input_ids"], data.get("loss_mask")
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise RowProblem("input_ids must be a non-empty list of integers")
            if mask is None:
                raise RowProblem("pre-tokenised row has input_ids but no loss_mask")
            if len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
                raise RowProblem(f"loss_mask must be {len(ids)} values of 0/1, got {len(mask)} values")
            vocab = len(self.tok)
            if any(t < 0 or t >= vocab for t in ids):
                raise RowProblem(f"input_ids hold ids outside the vocabulary (size {vocab})")
            return Tokenised(sample_id, list(ids), [int(m) for m in mask])
        ids, mask = self.encode_chat(normalise_messages(data))
        if not any(mask):
            raise RowProblem("the assistant turns are empty after tokenisation")
        return Tokenised(sample_id, ids, mask)
