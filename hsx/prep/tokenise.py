"""Turning a dataset row into (input_ids, loss_mask) with the target's chat template.

input_ids are exactly ``tokenizer.apply_chat_template(messages, tools=tools, **template_kwargs)`` of the
row's normal form (hsx/prep/rows.py): the template's rendering tokenised without added special tokens.
loss_mask (0/1, one per token) is 1 on every token that overlaps an assistant turn's body as located by
hsx/prep/mask.py in that same rendering. Per row: two template renders, one or two more per assistant turn
(its generation prompt, docs/data.md) and one tokenizer call.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from hsx.errors import HsxError
from hsx.prep.columns import ColumnMapping
from hsx.prep.mask import LOCATED_BY, TemplateError, TemplateShape, assistant_spans, probe_shape
from hsx.prep.perturn import turn_id, turns
from hsx.prep.rejected import RowRejected
from hsx.prep.rows import given_parts, read_conversation

__all__ = ["ChatTokeniser", "RowProblem", "RowRejected", "TemplateArgsError", "TemplateError", "Tokenised",
           "parse_template_kwargs"]

RowProblem = RowRejected   # the former name


class TemplateArgsError(HsxError, ValueError):
    """--template-kwargs text is malformed."""


@dataclass(frozen=True)
class Tokenised:
    sample_id: str
    input_ids: np.ndarray       # int32 [T]
    loss_mask: np.ndarray       # uint8 [T], 1 = a token the drafter learns
    source_format: str          # openai | sharegpt | instruction | pretokenised


def parse_template_kwargs(text: str | None) -> dict[str, Any]:
    """``--template-kwargs``: a JSON object, or ``key=value,...`` with JSON values (bare words stay strings).

    >>> parse_template_kwargs("enable_thinking=false,reasoning_effort=high")
    {'enable_thinking': False, 'reasoning_effort': 'high'}
    """
    if not text or not text.strip():
        return {}
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise TemplateArgsError(f"template arguments {text!r}: not a JSON object ({exc})") from None
        if not isinstance(value, dict):
            raise TemplateArgsError(f"template arguments {text!r}: want a JSON object")
        return value
    out: dict[str, Any] = {}
    for pair in text.split(","):
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise TemplateArgsError(f"template arguments {text!r}: {pair!r} is not key=value")
        try:
            out[key.strip()] = json.loads(raw.strip())
        except ValueError:
            out[key.strip()] = raw.strip()
    return out


def _call_convo(args, content) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "HsXprobeU1Q"},
            {"role": "assistant", "content": content, "tool_calls": [
                {"type": "function", "id": "HsXcall01", "function": {"name": "lookup", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "HsXcall01", "name": "lookup", "content": "HsXprobeT1Q"},
            {"role": "assistant", "content": "HsXprobeA3Q"}]


PROBE_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a text up.", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]


def probe_arguments(render) -> tuple[bool, bool, bool]:
    """(string tool-call arguments are rendered verbatim as text, object ones make the template fail, a call
    turn's null content reaches the template as None), from a few renders of a one-call conversation.

    A template that dumps arguments with ``tojson`` or iterates them needs an object: string arguments are
    parsed for it. A null content stays None only where the template reads None otherwise than "" and writes
    no "None" for it (DeepSeek style: calls rendered when the content is none); else it becomes "".
    Unknown (the probe refused): (False, False, False)."""
    text = '{"q":"HsXprobeV1Q\\u00e9"}'       # compact separators and an escape: verbatim means as text

    def rendered(args, content):
        try:
            return render(_call_convo(args, content), PROBE_TOOLS, False)
        except Exception:
            return None

    as_text = any(text in (rendered(text, content) or "") for content in ("", None))
    args = text if as_text else json.loads(text)
    objects_fail = as_text and rendered(json.loads(text), "") is None and rendered(json.loads(text), None) is None
    if objects_fail:
        args = text
    with_none, with_empty = rendered(args, None), rendered(args, "")
    null_content = (with_none is not None and with_none != with_empty
                    and with_none.count("None") == (with_empty or "").count("None"))
    return as_text, objects_fail, null_content


def probe_parts(render) -> bool:
    """Whether the template renders a content given as a list of text parts as its text (at most its blanks
    otherwise than the string, no part's repr): then a row's parts reach it as given (Llama-4-like templates
    trim each part, not a string)."""
    def rendered(content):
        return render([{"role": "user", "content": content}, {"role": "assistant", "content": "HsXprobeA1Q"}], None, False)

    try:
        text, parts = rendered(" HsXprobeU1Q\n"), rendered([{"type": "text", "text": " HsXprobeU1Q\n"}])
    except Exception:
        return False
    return "HsXprobeU1Q" in parts and "".join(parts.split()) == "".join(text.split())


def sample_id_of(data: dict[str, Any], index: int, mapping: ColumnMapping) -> str:
    """The row's stable id: its id column when present, else its 0-based position in the dataset. RowRejected
    (``bad_id``) for an id that is no string or number (an object, a list, true: it became its Python repr), or
    an empty one."""
    value = data.get(mapping.id)
    if value is None:
        return str(index)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowRejected("bad_id", f"id column {mapping.id!r} holds a {type(value).__name__} "
                          f"({repr(value)[:60]}), not a string or a number")
    if not str(value).strip():
        raise RowRejected("bad_id", f"id column {mapping.id!r} is empty")
    return str(value)


class ChatTokeniser:
    """Wraps a Hugging Face fast tokenizer that has a chat template; one per process (not shared)."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None,
                 columns: ColumnMapping | None = None):
        """``columns``: how rows map to turns (hsx/prep/columns.py); None = the defaults."""
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; hsx needs one to tokenise chat rows")
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError("hsx needs a fast tokenizer (character offsets) to build the loss mask")
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.columns = columns or ColumnMapping()
        specials = tuple(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)
        self.shape: TemplateShape = probe_shape(self.render, specials)
        # A template that reads message.thinking and not message.reasoning_content (gpt-oss style) gets the
        # reasoning under that name.
        source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template)
        self.reasoning_key = ("thinking" if "reasoning_content" not in source and re.search(r"\bthinking\b", source)
                              else "reasoning_content")
        self.text_arguments, self.objects_as_text, self.null_content = probe_arguments(self.render)
        self.takes_parts = probe_parts(self.render)
        self.located: Counter = Counter()   # how each assistant turn's start was found (mask.LOCATED_BY's keys)

    @property
    def locating(self) -> str:
        """How this template's turns are located and its tool-call arguments passed, in words (hsx inspect)."""
        if self.text_arguments:
            args = "string tool-call arguments rendered verbatim as text" + (
                ", object ones written as JSON text (the template fails on objects)" if self.objects_as_text else "")
        else:
            args = "string tool-call arguments parsed to objects (the template needs objects)"
        if self.null_content:
            args += "; a call turn's null content passed as None (the template tells it from \"\")"
        if self.takes_parts:
            args += "; other turns' text parts passed as given (the template renders parts)"
        return f"{self.shape.describe()}; {args}"

    def located_counts(self) -> str:
        """How many assistant turns encoded so far had their start found each way, in words."""
        return ", ".join(f"{LOCATED_BY[how]}: {n}" for how, n in self.located.most_common())

    def render(self, messages: list[dict[str, Any]], tools=None, add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def _render_row(self, messages, tools, add_generation_prompt: bool = False) -> str:
        try:
            return self.render(messages, tools, add_generation_prompt)
        except Exception as exc:  # a template's raise_exception(), or a field it cannot handle
            raise RowRejected("template_error", f"the chat template refuses the row: {type(exc).__name__}: {exc}") from exc

    def _prepare(self, messages: list[dict[str, Any]], as_text: bool = False) -> list[dict[str, Any]]:
        """The normal form adapted to this template: reasoning under ``reasoning_key``; tool-call arguments
        given as JSON text kept verbatim where the template takes text, parsed where it needs an object;
        object arguments written as JSON text where the template fails on objects (it concatenates them); a
        call turn's null content as None only where the template tells None from "" (probe_arguments).
        ``as_text``: every argument as text, whatever the probes said (the retry of _render_real)."""
        out = []
        for msg in messages:
            if self.reasoning_key != "reasoning_content" and "reasoning_content" in msg:
                msg = {**msg, self.reasoning_key: msg["reasoning_content"]}
                del msg["reasoning_content"]
            if msg.get("tool_calls"):
                msg = {**msg, "tool_calls": [self._call(c, as_text) for c in msg["tool_calls"]]}
            if msg.get("content", "") is None and not self.null_content:
                msg = {**msg, "content": ""}
            out.append(msg)
        return out

    def _call(self, call: dict[str, Any], as_text: bool) -> dict[str, Any]:
        args = call["function"]["arguments"]
        if isinstance(args, str) and not (self.text_arguments or as_text):
            args = json.loads(args)             # rows.py checked it holds a JSON object
        elif isinstance(args, dict) and (self.objects_as_text or as_text):
            args = json.dumps(args, ensure_ascii=False)
        else:
            return call
        return {**call, "function": {**call["function"], "arguments": args}}

    def _render_real(self, messages, tools) -> tuple[list[dict[str, Any]], str]:
        """(messages as rendered, rendering); retries once with object arguments as text if the template fails
        on objects (a template the probe could not judge)."""
        prepared = self._prepare(messages)
        try:
            return prepared, self.render(prepared, tools)
        except Exception as exc:
            objects = any(isinstance(c["function"]["arguments"], dict) for m in prepared for c in m.get("tool_calls", []))
            if self.objects_as_text or not objects:
                raise RowRejected("template_error", f"the chat template refuses the row: {type(exc).__name__}: {exc}") from exc
            first = exc
        prepared = self._prepare(messages, as_text=True)
        try:
            text = self.render(prepared, tools)
        except Exception:
            raise RowRejected("template_error", f"the chat template refuses the row: {type(first).__name__}: {first}") from first
        self.text_arguments = self.objects_as_text = True
        return prepared, text

    def encode_chat(self, messages: list[dict[str, Any]], tools=None,
                    trained: range | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of a conversation in normal form; ``trained``: the messages whose
        assistant turns are in the mask (None: every assistant turn)."""
        messages, real = self._render_real(messages, tools)
        spans = assistant_spans(real, messages, tools, self._render_row, self.shape, self.located, trained)
        ids, offsets = self._encode(real)
        return ids, spans_to_mask(offsets, spans)

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 [T], character offsets int64 [T, 2]) of ``text`` without added special tokens: what
        apply_chat_template(tokenize=True) gives. The Rust tokenizer is called directly when the wrapper adds
        nothing (no split_special_tokens): the same call the wrapper makes, without building its BatchEncoding."""
        backend = getattr(self.tok, "_tokenizer", None)
        try:
            if backend is not None and not getattr(self.tok, "split_special_tokens", False):
                enc = backend.encode(text, add_special_tokens=False)
                raw_ids, raw_offsets = enc.ids, enc.offsets
            else:
                out = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
                raw_ids, raw_offsets = out["input_ids"], out["offset_mapping"]
        except TypeError:   # what the Rust tokenizer says of a str it cannot take; the row's text, if it is that
            _check_unicode(text)
            raise
        count = len(raw_ids)
        ids = np.fromiter(raw_ids, dtype=np.int32, count=count)
        offsets = np.fromiter(chain.from_iterable(raw_offsets), dtype=np.int64, count=2 * count).reshape(count, 2)
        return ids, offsets

    def encode_row(self, data: dict[str, Any], index: int) -> Tokenised:
        sample_id = sample_id_of(data, index, self.columns)
        if data.get("input_ids") is not None:
            return Tokenised(sample_id, *self._pretokenised(data), "pretokenised")
        messages, conversation = self._conversation(data)
        ids, mask = self.encode_chat(messages, conversation.tools)
        if not mask.any():
            raise RowRejected("no_assistant_tokens", "the assistant turns are empty after tokenisation")
        return Tokenised(sample_id, ids, mask, conversation.source_format)

    def encode_turns(self, data: dict[str, Any], index: int) -> list[Tokenised]:
        """``--per-turn``: one sample a turn of the row, ids ``<row id>#t<j>`` (hsx/prep/perturn.py)."""
        row_id = sample_id_of(data, index, self.columns)
        if data.get("input_ids") is not None:
            return [Tokenised(turn_id(row_id, 0), *self._pretokenised(data), "pretokenised")]
        messages, conversation = self._conversation(data)
        prepared, _ = self._render_real(messages, conversation.tools)   # the arguments as the whole row needs them
        out = []
        for j, turn in enumerate(turns(prepared, conversation.tools, self._render_row, self.tok.eos_token)):
            ids, mask = self.encode_chat(messages[:turn.stop], conversation.tools, trained=turn)
            if not mask.any():
                raise RowRejected("no_assistant_tokens", f"turn {j} (messages {turn.start}-{turn.stop - 1}): its "
                                                         "assistant messages are empty after tokenisation")
            out.append(Tokenised(turn_id(row_id, j), ids, mask, conversation.source_format))
        return out

    def _conversation(self, data: dict[str, Any]):
        """(messages in normal form, as this template takes them; the row's Conversation)."""
        conversation = read_conversation(data, self.columns)
        messages = conversation.messages
        if self.takes_parts and conversation.source_format == "openai":
            messages = given_parts(messages, data.get(self.columns.messages))
        return messages, conversation

    def _pretokenised(self, data: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = data["input_ids"], data.get("loss_mask")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise RowRejected("bad_pretokenised", "input_ids must be a non-empty list of integers")
        if mask is None:
            raise RowRejected("bad_pretokenised", "pre-tokenised row has input_ids but no loss_mask")
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
            raise RowRejected("bad_pretokenised", f"loss_mask must be {len(ids)} values of 0/1")
        vocab = len(self.tok)
        try:
            ids_array = np.asarray(ids, dtype=np.int64)
        except OverflowError:   # an id past int64: outside any vocabulary
            ids_array = np.asarray([-1])
        if ids_array.min() < 0 or ids_array.max() >= vocab:
            raise RowRejected("bad_pretokenised", f"input_ids hold ids outside the vocabulary (size {vocab})")
        return ids_array.astype(np.int32), np.asarray(mask, dtype=np.uint8)


def _check_unicode(text: str) -> None:
    """RowRejected when ``text`` is not valid Unicode: a lone UTF-16 surrogate, which JSON text can hold
    (``"\\ud800"``) and no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowRejected("bad_content", f"the row holds text that is not valid Unicode ({exc.reason}: "
                                         f"{text[exc.start:exc.end]!r} at character {exc.start})") from None


def spans_to_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [T]: 1 where token t's characters [offsets[t,0], offsets[t,1]) overlap a span (start, end)."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not spans or not len(offsets):
        return mask
    token_starts = offsets[:, 0]
    token_ends = np.maximum.accumulate(offsets[:, 1])
    span_array = np.asarray(spans, dtype=np.int64)
    first = np.searchsorted(token_ends, span_array[:, 0], side="right")   # first token ending after the start
    last = np.searchsorted(token_starts, span_array[:, 1], side="left")   # first token starting at/after the end
    delta = np.zeros(len(offsets) + 1, dtype=np.int32)
    keep = first < last
    np.add.at(delta, first[keep], 1)
    np.add.at(delta, last[keep], -1)
    mask[np.cumsum(delta[:-1]) > 0] = 1
    return mask
