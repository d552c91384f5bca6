"""Where the assistant turns land in one rendering of a whole conversation (the loss mask's spans).

No prefix renders: the template need not render a conversation's prefix as a prefix of the whole (templates
that drop history turns' reasoning do not). Instead, per row:

1. ``real``   = the template's rendering of the conversation (what gets tokenised).
2. ``marked`` = the rendering of a copy in which every assistant content and reasoning that is not blank,
   and every tool-call name, is replaced by a unique marker ``<base><n>Q`` (other turns are left as they
   are, so a template branching on them, e.g. on a user turn that holds tool results, branches alike). The markers split ``marked`` into
   the template's own text (skeleton pieces S0 .. Sn) around them.
3. Align: ``real`` must read S0 V1 S1 V2 .. Vn Sn, where Vi is marker i's value as the template rendered it
   (verbatim, or stripped / JSON-escaped; any other rewrite is found by searching for the next piece).
   The alignment must consume ``real`` exactly, else the row is rejected (``turn_not_located``).
4. Assistant turn k's span: from the end of the last assistant header (TemplateShape.headers, the
   longest found) in the piece before its first marker, to the end of the first end-of-turn marker (TemplateShape.end) in the
   piece after its last marker. Inside: its rendered reasoning, content, tool calls and end-of-turn
   marker; outside: role headers, other turns, the tools list. A turn whose reasoning the template does
   not render simply has no reasoning in its span.

TemplateShape is learned once per (template, template arguments) from five tiny probe renders.
Spans are character offsets into ``real``, end-exclusive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hsx.errors import HsxError
from hsx.prep.rows import RowRejected

Render = Callable[..., str]      # render(messages, tools, add_generation_prompt) -> text
MAX_BACKTRACK = 256             # alignment attempts beyond the first before a row is rejected
REASONING_FIELDS = ("reasoning_content", "thinking")


class TemplateError(HsxError, ValueError):
    """hsx cannot place a loss mask with this chat template at all (the whole run, not one row)."""


@dataclass(frozen=True)
class TemplateShape:
    headers: tuple[str, ...]   # texts that open an assistant turn's body, longest first, e.g.
                               # ("<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n") for a template
                               # whose generation prompt opens the reasoning block of the last turns only;
                               # the longest found before a turn is its header
    end: str                   # text that closes it, e.g. "<|im_end|>\n" (ChatML) or "<|eot_id|>" (Llama 3)
    calls_end_alike: bool = False  # a tool-call turn followed by a tool result also ends at the first ``end``
                                   # (probed); else each turn's end is found by rendering the cut conversation


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def _header_in(generation_prompt: str, before_answer: str) -> str:
    """The longest non-blank prefix of the generation prompt rendered before an answer (else that text)."""
    for n in range(len(generation_prompt), 0, -1):
        if generation_prompt[:n].strip() and generation_prompt[:n] in before_answer:
            return generation_prompt[:n]
    return before_answer


def probe_shape(render: Render) -> TemplateShape:
    """Learn the assistant headers and end-of-turn marker from renders of tiny conversations.

    The header of a turn is what the generation prompt renders before an answer: the part of it found
    before the last answer (after the last user turn), and the part found before an earlier answer.
    """
    u1, a1, u2, a2 = "HsXprobeU1Q", "HsXprobeA1Q", "HsXprobeU2Q", "HsXprobeA2Q"
    convo = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
             {"role": "user", "content": u2}, {"role": "assistant", "content": a2}]
    try:
        bare, prompted = render(convo[:1], None, False), render(convo[:1], None, True)
        one, two, three = (render(convo[:n], None, False) for n in (2, 3, 4))
    except Exception as exc:
        raise TemplateError(f"the chat template fails on a plain user/assistant conversation: {exc}") from exc
    if not all(m in t for t, ms in ((one, (u1, a1)), (two, (u1, a1, u2)), (three, (u1, a1, u2, a2))) for m in ms):
        raise TemplateError("the chat template does not render message contents verbatim; cannot place a loss mask")
    generation_prompt = prompted[len(bare):] if prompted.startswith(bare) else ""
    last = _header_in(generation_prompt, one[one.index(u1) + len(u1):one.index(a1)])
    earlier = _header_in(generation_prompt, three[three.index(u1) + len(u1):three.index(a1)])
    # Also every line of the generation prompt beyond the shortest header: a turn renders as much of the
    # prompt as it renders (a thinking turn "<think>\n" + reasoning where the prompt is an empty block).
    lines = {generation_prompt[:n + 1] for n, ch in enumerate(generation_prompt)
             if ch == "\n" and n + 1 > len(min(last, earlier, key=len))}
    headers = tuple(sorted({last, earlier} | lines, key=len, reverse=True))
    if not all(h.strip() for h in headers):
        raise TemplateError("the chat template renders no assistant role header (no generation prompt, nothing "
                            "between a user turn and the answer); cannot tell where an answer starts")
    tail, between = one[one.index(a1) + len(a1):], two[two.index(a1) + len(a1):two.index(u2)]
    end = _common_prefix(tail, between)     # e.g. "<|im_end|>\n": what every assistant turn ends with
    if not end.strip():
        raise TemplateError("the chat template renders nothing after an assistant turn; cannot tell where it ends")
    return TemplateShape(headers=headers, end=end, calls_end_alike=_calls_end_alike(render, end))


def _calls_end_alike(render: Render, end: str) -> bool:
    """Whether a tool-call turn, followed by its result, ends at the first ``end`` after its call as the
    template itself says (the conversation rendered cut after the call turn). False when it ends otherwise
    (e.g. <|eom_id|> or <|call|>) or the template will not render the probe."""
    value, result = "HsXprobeV1Q", "HsXprobeT1Q"
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call_1", "function": {"name": "lookup", "arguments": {"query": value}}}]}
    convo = [{"role": "user", "content": "HsXprobeU1Q"}, call,
             {"role": "tool", "tool_call_id": "call_1", "name": "lookup", "content": result},
             {"role": "assistant", "content": "HsXprobeA3Q"}]
    try:
        whole, cut = render(convo, None, False), render(convo[:2], None, False)
    except Exception:
        return False
    if value not in cut or result not in whole:
        return False
    after = whole[whole.index(value) + len(value):whole.index(result)]
    length = len(_common_prefix(cut[cut.index(value) + len(value):], after))
    at = after.find(end)
    return at >= 0 and at + len(end) == length


def _marker_base(real: str) -> str:
    for attempt in range(1000):
        base = f"HsXm{attempt}K"
        if base not in real:
            return base
    raise RowRejected("turn_not_located", "the conversation contains every candidate marker text")


def _marked_copy(messages: list[dict[str, Any]], base: str, reasoning_key: str):
    """(marked messages, values, owner): values[i] is marker i's real text, owner[i] its message index."""
    values: list[str] = []
    owner: list[int] = []

    def mark(value: str, index: int) -> str:
        values.append(value)
        owner.append(index)
        return f"{base}{len(values) - 1}Q"

    marked = []
    for index, msg in enumerate(messages):
        if msg["role"] != "assistant":      # other turns render as they are: a template may branch on them
            marked.append(msg)
            continue
        copy = dict(msg)
        for key in REASONING_FIELDS:        # whitespace-only values stay: a template may test them for emptiness
            if isinstance(msg.get(key), str) and msg[key].strip():
                copy[key] = mark(msg[key], index)
        content = msg["content"]
        if "</think>" in content and not any(isinstance(msg.get(k), str) for k in REASONING_FIELDS):
            # Reasoning written inline: thinking templates split it off into the reasoning block.
            reasoning, _, content = content.partition("</think>")
            copy[reasoning_key] = mark(reasoning.split("<think>")[-1], index)
        copy["content"] = mark(content, index) if content.strip() else content
        if msg.get("tool_calls"):
            copy["tool_calls"] = [_marked_call(call, mark, index) for call in msg["tool_calls"]]
        marked.append(copy)
    return marked, values, owner


def _marked_call(call: dict[str, Any], mark: Callable[[str, int], str], index: int) -> dict[str, Any]:
    """The call with its first non-blank string argument value marked, else its name: a template may branch
    on the name (builtin tools rendered another way, e.g. ``<|python_tag|>name.call(...)``), hardly on a value."""
    function, arguments = call["function"], call["function"].get("arguments")
    if isinstance(arguments, dict):
        for key, value in arguments.items():
            if isinstance(value, str) and value.strip():
                return {**call, "function": {**function, "arguments": {**arguments, key: mark(value, index)}}}
    return {**call, "function": {**function, "name": mark(function["name"], index)}}


def _renderings(value: str):
    """How a template may have rendered a value: verbatim first, then common rewrites."""
    yield value
    for variant in (value.strip(), value.strip("\n"), value.lstrip("\n"), value.rstrip("\n"), value.lstrip(),
                    value.rstrip(), json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]):
        if variant != value:
            yield variant


def _align(real: str, pieces: list[str], values: list[str]) -> list[int] | None:
    """Start offset in ``real`` of every skeleton piece, or None when ``real`` is not S0 V1 S1 .. Vn Sn."""
    if not real.startswith(pieces[0]):
        return None
    n, last = len(values), len(values)
    starts = [0] * (n + 1)
    pos = len(pieces[0])
    fast = True
    for i in range(1, n + 1):       # fast path: every value verbatim
        value, piece = values[i - 1], pieces[i]
        if not (real.startswith(value, pos) and real.startswith(piece, pos + len(value))):
            fast = False
            break
        starts[i] = pos + len(value)
        pos = starts[i] + len(piece)
    if fast:
        return starts if pos == len(real) else None

    budget = [MAX_BACKTRACK]

    def options(i: int, pos: int):
        """End offsets of value i (1-based) rendered at ``pos`` that are followed by piece i."""
        piece, seen = pieces[i], set()
        for variant in _renderings(values[i - 1]):
            end = pos + len(variant)
            if end not in seen and real.startswith(variant, pos) and real.startswith(piece, end):
                seen.add(end)
                yield end
        if i == last:
            end = len(real) - len(piece)
            if end >= pos and real.endswith(piece) and end not in seen:
                yield end
            return
        if piece:
            end = real.find(piece, pos)
            while end != -1 and budget[0] > 0:
                budget[0] -= 1
                if end not in seen:
                    yield end
                end = real.find(piece, end + 1)

    stack = [(1, len(pieces[0]), options(1, len(pieces[0])))]
    while stack:
        i, pos, it = stack[-1]
        end = next(it, None)
        if end is None or budget[0] <= 0:
            stack.pop()
            continue
        starts[i] = end
        after = end + len(pieces[i])
        if i == last:
            if after == len(real):
                return starts
            continue
        stack.append((i + 1, after, options(i + 1, after)))
    return None


def _first_mismatch(real: str, pieces: list[str], values: list[str]) -> int:
    """Index (0-based) of the first value not rendered verbatim and followed by its piece (for the message)."""
    pos = len(pieces[0])
    for i, value in enumerate(values):
        if not (real.startswith(value, pos) and real.startswith(pieces[i + 1], pos + len(value))):
            return i
        pos += len(value) + len(pieces[i + 1])
    return len(values) - 1


def assistant_spans(real: str, messages: list[dict[str, Any]], tools, render: Render, shape: TemplateShape,
                    reasoning_key: str = "reasoning_content") -> list[tuple[int, int]]:
    """(start, end) character spans of every assistant turn's body in ``real``, in turn order.
    ``reasoning_key``: the message field the template reads reasoning from."""
    base = _marker_base(real)
    marked, values, owner = _marked_copy(messages, base, reasoning_key)
    pattern = re.compile(re.escape(base) + r"(\d+)Q")
    parts = pattern.split(render(marked, tools, False))
    pieces, order = parts[0::2], [int(p) for p in parts[1::2]]
    starts = _align(real, pieces, [values[i] for i in order])
    if starts is None:
        index = owner[order[_first_mismatch(real, pieces, [values[i] for i in order])]] if order else 0
        raise RowRejected("turn_not_located", f"turn {index} ({messages[index]['role']}): the rendering with marked "
                                              "contents does not line up with the real rendering (the template "
                                              "rewrites a content in a way hsx cannot follow)")
    occurrences: dict[int, list[int]] = {}       # message index -> positions (1-based) in `order`
    for position, marker in enumerate(order, 1):
        occurrences.setdefault(owner[marker], []).append(position)
    spans = []
    for index, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        where = occurrences.get(index)
        if not where:
            raise RowRejected("turn_not_located", f"turn {index} (assistant): the template does not render it")
        first, last = where[0], where[-1]
        if any(owner[order[p - 1]] != index for p in range(first, last + 1)):
            raise RowRejected("turn_not_located", f"turn {index} (assistant): other turns are rendered inside it")
        lo, hi = starts[first - 1], starts[first - 1] + len(pieces[first - 1])
        start = next((at + len(h) for h in shape.headers if (at := real.rfind(h, lo, hi)) >= 0), -1)
        if start < 0:
            raise RowRejected("turn_not_located", f"turn {index} (assistant): no role header {shape.headers[-1]!r} before it")
        lo, hi = starts[last], starts[last] + len(pieces[last])
        if index == len(messages) - 1:
            at = real.find(shape.end, lo, hi)
            end = at + len(shape.end) if at >= 0 else hi   # the final turn: its end marker, else the text's end
        elif shape.calls_end_alike and (at := real.find(shape.end, lo, hi)) >= 0:
            end = at + len(shape.end)
        else:
            end = lo + _rendered_end(render, marked, tools, index, f"{base}{order[last - 1]}Q", pieces[last])
        spans.append((start, end))
    return spans


def _rendered_end(render: Render, marked: list[dict[str, Any]], tools, index: int, last_marker: str,
                  piece: str) -> int:
    """Length of the part of ``piece`` (the text after turn ``index``'s last marker, up to the next marker)
    that still belongs to the turn: what the template renders after that marker when the conversation
    ends with the turn, as far as it agrees with ``piece``. The template itself says where the turn ends,
    whatever its end token (<|eot_id|>, <|eom_id|> after a call, <|call|>, ...)."""
    cut = render(marked[:index + 1], tools, False)
    at = cut.rfind(last_marker)
    if at < 0:
        raise RowRejected("turn_not_located", f"turn {index} (assistant): the template does not render it when "
                                              "the conversation ends with it; cannot tell where it ends")
    length = len(_common_prefix(cut[at + len(last_marker):], piece))
    if not piece[:length].strip():
        raise RowRejected("turn_not_located", f"turn {index} (assistant): the template renders nothing after it "
                                              "that it also renders when the turn is last; cannot tell where it ends")
    return length
