"""The marked copy of a conversation and its alignment with the real rendering (used by hsx/prep/mask.py).

A marked copy replaces every assistant text the model writes with a unique marker ``<base><n>Q``: the
non-blank core of each content and reasoning field (its surrounding whitespace, and any inline ``<think>`` /
``</think>`` tags, stay where they are, so a template that trims, splits or cuts them does the same to the
copy), and one value of each tool call (its first non-blank string argument, the whole argument text when
the arguments are a string, else the name). Other turns are left as they are: a template may branch on them.
The markers cut the copy's rendering into the template's own text (skeleton pieces S0 .. Sn); ``align``
finds each piece's offset in the real rendering, which must read S0 V1 S1 .. Vn Sn. Also the text helpers
mask.py's turn location uses (agreement, splits_special, after_marker, context_end, header_in).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from os.path import commonprefix
from typing import Any

from hsx.prep.rejected import RowRejected

MAX_BACKTRACK = 256             # alignment attempts beyond the first before a row is rejected
REASONING_FIELDS = ("reasoning_content", "thinking")
THINK_TAGS = re.compile(r"(<think>|</think>)")
CONTEXT_ANCHOR = 16             # characters of a turn's context that must match where the context differs
CONTEXT_CHARS = 48              # characters either side of a place quoted in a rejection


def escaped(text: str) -> str:
    """``text`` with control characters (newlines too) written as escapes: one printable line."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def around(text: str, at: int) -> str:
    """The text either side of offset ``at``, escaped, the place shown as ``|>``: for a rejection message."""
    lo, hi = max(0, at - CONTEXT_CHARS), min(len(text), at + CONTEXT_CHARS)
    return ("..." if lo else "") + escaped(text[lo:at]) + "|>" + escaped(text[at:hi]) + ("..." if hi < len(text) else "")


def marker_base(real: str) -> str:
    for attempt in range(1000):
        base = f"HsXm{attempt}K"
        if base not in real:
            return base
    raise RowRejected("turn_not_located", "the conversation contains every candidate marker text")


def marked_copy(messages: list[dict[str, Any]], base: str):
    """(marked messages, values, owner): values[i] is marker i's real text, owner[i] its message index."""
    values: list[str] = []
    owner: list[int] = []

    def mark(value: str, index: int) -> str:
        values.append(value)
        owner.append(index)
        return f"{base}{len(values) - 1}Q"

    def mark_text(text: str, index: int) -> str:
        out = []
        for part in THINK_TAGS.split(text):
            core = part.strip()
            if not core or part in ("<think>", "</think>"):
                out.append(part)        # whitespace-only texts stay: a template may test them for emptiness
            else:
                lead, trail = part[:len(part) - len(part.lstrip())], part[len(part.rstrip()):]
                out.append(lead + mark(core, index) + trail)
        return "".join(out)

    marked = []
    for index, msg in enumerate(messages):
        if msg["role"] != "assistant":
            marked.append(msg)
            continue
        copy = dict(msg)
        for key in REASONING_FIELDS:
            if isinstance(msg.get(key), str):
                copy[key] = mark_text(msg[key], index)
        if isinstance(msg["content"], str):
            copy["content"] = mark_text(msg["content"], index)
        elif isinstance(msg["content"], list):      # text parts, for a template that renders parts
            copy["content"] = [{**part, "text": mark_text(part["text"], index)} for part in msg["content"]]
        if msg.get("tool_calls"):
            copy["tool_calls"] = [_marked_call(call, mark, index) for call in msg["tool_calls"]]
        marked.append(copy)
    return marked, values, owner


def _marked_call(call: dict[str, Any], mark: Callable[[str, int], str], index: int) -> dict[str, Any]:
    """The call with every non-blank string argument value marked (the whole text of string arguments, which
    the template renders as text), else its name: a template may branch on the name (builtin tools rendered
    another way, e.g. ``<|python_tag|>name.call(...)``), hardly on a value. Every value, not the first only: the
    turn's end is looked for after its last marker, and an unmarked argument after it holding the end marker's
    text (a coding agent writing a file with "<|eot_id|>" in it) ended the mask there, the real end left out."""
    function, arguments = call["function"], call["function"].get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        return {**call, "function": {**function, "arguments": mark(arguments, index)}}
    if isinstance(arguments, dict) and any(isinstance(v, str) and v.strip() for v in arguments.values()):
        return {**call, "function": {**function, "arguments": {
            key: mark(value, index) if isinstance(value, str) and value.strip() else value
            for key, value in arguments.items()}}}
    return {**call, "function": {**function, "name": mark(function["name"], index)}}


def _renderings(value: str):
    """How a template may have rendered a value: verbatim first, then common rewrites."""
    yield value
    for variant in (value.strip(), value.strip("\n"), value.lstrip("\n"), value.rstrip("\n"), value.lstrip(),
                    value.rstrip(), json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]):
        if variant != value:
            yield variant


def align(real: str, pieces: list[str], values: list[str]) -> list[int] | None:
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


def first_mismatch(real: str, pieces: list[str], values: list[str]) -> tuple[int, int]:
    """(index 0-based of the first value not rendered verbatim and followed by its piece, its offset in
    ``real``): where a rejection message points."""
    if not real.startswith(pieces[0]):
        return 0, len(commonprefix([real, pieces[0]]))
    pos = len(pieces[0])
    for i, value in enumerate(values):
        if not (real.startswith(value, pos) and real.startswith(pieces[i + 1], pos + len(value))):
            return i, pos
        pos += len(value) + len(pieces[i + 1])
    return max(len(values) - 1, 0), pos


def agreement(a: str, b: str, specials: tuple[str, ...]) -> int:
    """Length of the common prefix of ``a`` and ``b``, backed off to the start of a special token it ends
    inside (``<|end|>\n<|`` of ``<|end|>\n<|endoftext|>`` and ``<|end|>\n<|tool|>``), unless that leaves
    nothing but blanks (the template swaps one end token for another: ``<|return|>`` for ``<|end|>``)."""
    n = len(commonprefix([a, b]))
    back = min((i for t in (a, b) for s in specials if 0 <= (i := t.find(s, max(0, n - len(s) + 1))) < n), default=n)
    return back if a[:back].strip() else n


def splits_special(text: str, at: int, specials: tuple[str, ...]) -> bool:
    """Whether offset ``at`` falls strictly inside a special token of ``text``."""
    return any(0 <= text.find(s, max(0, at - len(s) + 1)) < at for s in specials)


def after_marker(text: str, pattern: re.Pattern, previous: int | None) -> str | None:
    """``text`` after its last marker, when that marker is ``previous`` (None: no marker); else None."""
    found = next(iter(reversed(list(pattern.finditer(text)))), None)
    if (int(found.group(1)) if found else None) != previous:
        return None
    return text[found.end():] if found else text


def context_end(piece: str, bare: str, previous_content) -> int:
    """End offset in ``piece`` of the longest end of ``bare`` (the context rendered without the prompt) that the
    piece holds: at least CONTEXT_ANCHOR characters, or all of ``bare``, or the previous message's content
    and all the template writes after it; -1 when none is."""
    lo, hi = 0, min(len(bare), len(piece))      # the longest suffix found: a suffix of a found one is found too
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bare[len(bare) - mid:] in piece:
            lo = mid
        else:
            hi = mid - 1
    enough = min(CONTEXT_ANCHOR, len(bare))
    if isinstance(previous_content, str) and previous_content.strip() and previous_content in bare:
        enough = min(enough, len(bare) - bare.rindex(previous_content) - len(previous_content) + 1)
    if lo < enough:
        return -1
    return piece.rfind(bare[len(bare) - lo:]) + lo


def header_in(generation_prompt: str, before_answer: str) -> str:
    """The longest non-blank prefix of the generation prompt rendered before an answer (else that text)."""
    for n in range(len(generation_prompt), 0, -1):
        if generation_prompt[:n].strip() and generation_prompt[:n] in before_answer:
            return generation_prompt[:n]
    return before_answer
