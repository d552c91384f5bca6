"""Where the assistant turns land in one rendering of a whole conversation (the loss mask's spans).

The template need not render a conversation's prefix as a prefix of the whole (templates that drop history
turns' reasoning do not), so every offset is taken in the one rendering of the whole conversation. Per row:

1. ``real``   = the template's rendering of the conversation (what gets tokenised).
2. ``marked`` = the rendering of a copy in which every text the model writes is a unique marker
   (hsx/prep/marking.py); the markers cut it into the template's own text (skeleton pieces S0 .. Sn).
3. Align: ``real`` must read S0 V1 S1 .. Vn Sn, Vi being marker i's value as the template rendered it
   (verbatim, or stripped / JSON-escaped; any other rewrite is found by searching for the next piece), else
   the row is rejected (``turn_not_located``, quoting the text around the place).
4. Assistant turn k starts where the model starts writing it: the marked conversation up to the turn is
   rendered with the generation prompt, and the text after its last marker (the turn's context and the
   prompt) is laid over the skeleton piece before the turn's first marker. Where the piece runs on past the
   prompt, the rest is the model's (an empty prompt after ``[INST] ... [/INST]``: the answer's leading space;
   an answer right after tool outputs: everything after them); where the turn renders less of the prompt (a
   history turn without the prompt's ``<think>``), the turn starts at its first marker; where the two part in
   the prompt's own text (a prompt ``<think>`` against a finished turn's tool call), the turn starts at the
   last tag or line boundary before they part. Where the context renders otherwise in the cut conversation
   (a tools list or system text put before the last user turn only), the longest end of it found in the
   piece anchors it. Only when the template will not render the prompt, or no end of the context is found,
   is the learned role header looked for instead (TemplateShape.headers, the longest found in that piece).
5. Its end: the first end-of-turn marker (TemplateShape.end) in the piece after its last marker, for the
   final turn and wherever the probes show tool-call turns end alike; else as far as the marked conversation
   rendered cut after the turn agrees with the piece (the template's own end: <|eom_id|>, <|call|>, ...),
   never ending inside a special token (<|end|>\n, not <|end|>\n<| of a next <|tool|>); a turn the cut
   conversation leaves open (no end marker when last) takes the end marker that follows it. A template with no
   end-of-turn marker (GLM style: the next role marker ends the turn) ends it after the special token that
   opens the next turn (the model writes <|user|> or <|observation|> to stop); its last turn at the text's end.
   A template that ignores add_generation_prompt while a finished answer opens with a header is refused:
   whether the model writes that header is undefined.
   Inside: its rendered reasoning, content, tool calls and end-of-turn marker; outside: the generation
   prompt, other turns, the tools list. A turn whose reasoning the template does not render has none in it.

TemplateShape is learned once per (template, template arguments) from a few tiny probe renders.
Spans are character offsets into ``real``, end-exclusive.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from os.path import commonprefix
from typing import Any

from hsx.errors import HsxError
from hsx.prep.marking import (
    after_marker,
    agreement,
    align,
    around,
    context_end,
    escaped,
    first_mismatch,
    header_in,
    marked_copy,
    marker_base,
    splits_special,
)
from hsx.prep.rejected import RowRejected

Render = Callable[..., str]      # render(messages, tools, add_generation_prompt) -> text
BOUNDARY = frozenset(">]}\n \t")  # a prompt and a finished turn that part mid-text part after the last of these
LOCATED_BY = {"prompt": "the generation prompt rendered after their context",
              "anchored": "the generation prompt, their context anchored by its end (it renders otherwise cut)",
              "header": "the learned role header (the template refused the cut conversation)"}


class TemplateError(HsxError, ValueError):
    """hsx cannot place a loss mask with this chat template at all (the whole run, not one row)."""


@dataclass(frozen=True)
class TemplateShape:
    headers: tuple[str, ...]   # fallback only (a template that will not render the generation prompt): texts
                               # that open an assistant turn's body, longest first, e.g.
                               # ("<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n"); empty when
                               # the generation prompt is
    end: str                   # text that closes it, e.g. "<|im_end|>\n" (ChatML) or "<|eot_id|>" (Llama 3)
    calls_end_alike: bool = False  # a tool-call turn followed by a tool result also ends at the first ``end``
                                   # (probed); else each turn's end is found by rendering the cut conversation
    generation_prompt: str = ""    # after one user turn, e.g. "<|im_start|>assistant\n"; "" (Mistral style)
    specials: tuple[str, ...] = ()  # the tokenizer's special tokens, longest first: texts agree up to a whole
                                    # one; with no end-of-turn marker (``end`` empty, GLM style) the one that
                                    # opens the next turn ends the turn (the model writes it to stop: <|user|>)

    def describe(self) -> str:
        """How turns are located with this template, in words (hsx inspect prints it)."""
        prompt = escaped(self.generation_prompt) if self.generation_prompt else "empty"
        ends = (f"'{escaped(self.end)}'" + (" (tool-call turns too)" if self.calls_end_alike else
                                             "; tool-call turns where the conversation cut after them ends"))
        if not self.end:
            ends = ("the special token that opens the next turn (no end-of-turn marker; the model writes it to "
                    "stop), the last turn at the text's end")
        return (f"turns start where the generation prompt rendered after their context ('{prompt}' after a user "
                f"turn) leaves off (per-turn prompt renders); turns end at {ends}")



def probe_shape(render: Render, specials: tuple[str, ...] = ()) -> TemplateShape:
    """Learn the assistant headers and end-of-turn marker from renders of tiny conversations. ``specials``:
    the tokenizer's special tokens (a template with no end-of-turn marker ends a turn at the next one's).

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
    specials = tuple(sorted({s for s in specials if s.strip()}, key=len, reverse=True))
    # after the user turn; a bare render may end otherwise (an EOS after the whole conversation, Phi-3 style)
    generation_prompt = prompted[agreement(prompted, bare, specials):] if prompted != bare else ""
    opening = one[one.index(u1) + len(u1):one.index(a1)]
    opening = opening[len(commonprefix([opening, bare[bare.index(u1) + len(u1):]])):]
    if prompted == bare and opening.strip():
        raise TemplateError(f"the chat template ignores add_generation_prompt, yet a finished answer opens with "
                            f"'{escaped(opening)}': whether the model writes that is undefined; cannot place a loss mask")
    last = header_in(generation_prompt, one[one.index(u1) + len(u1):one.index(a1)])
    earlier = header_in(generation_prompt, three[three.index(u1) + len(u1):three.index(a1)])
    # Also every line of the generation prompt beyond the shortest header: a turn renders as much of the
    # prompt as it renders (a thinking turn "<think>\n" + reasoning where the prompt is an empty block).
    lines = {generation_prompt[:n + 1] for n, ch in enumerate(generation_prompt)
             if ch == "\n" and n + 1 > len(min(last, earlier, key=len))}
    # An empty prompt (Mistral style) has no header to learn: the text before an answer is the user turn's.
    headers = tuple(sorted({h for h in {last, earlier} | lines if h.strip()}, key=len, reverse=True)) \
        if generation_prompt.strip() else ()
    tail, between = one[one.index(a1) + len(a1):], two[two.index(a1) + len(a1):two.index(u2)]
    end = tail[:agreement(tail, between, specials)]    # e.g. "<|im_end|>\n": what every assistant turn ends with
    if not end.strip():     # the last turn renders none: what comes before the next turn's own opening, if any
        opening = render(convo[2:3], None, False)
        opening = opening[:opening.index(u2)] if u2 in opening else ""
        end = between[:len(between) - len(commonprefix([between[::-1], opening[::-1]]))]
    if not end.strip():     # no end-of-turn marker: the next turn's special token ends it (GLM style)
        if not any(between.lstrip().startswith(s) for s in specials):
            raise TemplateError("the chat template renders nothing after an assistant turn and the next turn opens "
                                f"with no special token ('{escaped(between[:40])}'); cannot tell where it ends")
        end = ""
    return TemplateShape(headers=headers, end=end, generation_prompt=generation_prompt, specials=specials,
                         calls_end_alike=bool(end) and _calls_end_alike(render, end, specials))


def _calls_end_alike(render: Render, end: str, specials: tuple[str, ...] = ()) -> bool:
    """Whether a tool-call turn, followed by its result, ends at the first ``end`` after its call as the
    template itself says (the conversation rendered cut after the call turn). False when it ends otherwise
    (e.g. <|eom_id|> or <|call|>) or the template will not render the probe (with object arguments, nor
    with them as JSON text)."""
    value, result = "HsXprobeV1Q", "HsXprobeT1Q"
    for arguments in ({"query": value}, '{"query": "' + value + '"}'):
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "lookup", "arguments": arguments}}]}
        convo = [{"role": "user", "content": "HsXprobeU1Q"}, call,
                 {"role": "tool", "tool_call_id": "call_1", "name": "lookup", "content": result},
                 {"role": "assistant", "content": "HsXprobeA3Q"}]
        try:
            whole, cut = render(convo, None, False), render(convo[:2], None, False)
        except Exception:
            continue
        if value not in cut or result not in whole:
            return False
        after = whole[whole.index(value) + len(value):whole.index(result)]
        length = agreement(cut[cut.index(value) + len(value):], after, specials)
        at = after.find(end)
        return at >= 0 and at + len(end) == length
    return False


def assistant_spans(real: str, messages: list[dict[str, Any]], tools, render: Render, shape: TemplateShape,
                    located: Counter | None = None, trained: range | None = None) -> list[tuple[int, int]]:
    """(start, end) character spans of every assistant turn's body in ``real``, in turn order. ``located``:
    counts how each turn's start was found (LOCATED_BY's keys). ``trained``: the message indexes whose spans
    are wanted (--per-turn: one turn's; hsx/prep/perturn.py), None for every assistant message."""
    base = marker_base(real)
    marked, values, owner = marked_copy(messages, base)
    pattern = re.compile(re.escape(base) + r"(\d+)Q")
    parts = pattern.split(render(marked, tools, False))
    pieces, order = parts[0::2], [int(p) for p in parts[1::2]]
    ordered = [values[i] for i in order]
    starts = align(real, pieces, ordered)
    if starts is None:
        position, at = first_mismatch(real, pieces, ordered)
        index = owner[order[position]] if order else 0
        raise RowRejected("turn_not_located", f"turn {index} ({messages[index]['role']}): the rendering with marked "
                                              "contents does not line up with the real rendering (the template "
                                              f"rewrites a text in a way hsx cannot follow) near: {around(real, at)}")
    occurrences: dict[int, list[int]] = {}       # message index -> positions (1-based) in `order`
    for position, marker in enumerate(order, 1):
        occurrences.setdefault(owner[marker], []).append(position)
    spans = []
    for index, msg in enumerate(messages):
        if msg["role"] != "assistant" or (trained is not None and index not in trained):
            continue
        where = occurrences.get(index)
        if not where:
            raise RowRejected("turn_not_located", f"turn {index} (assistant): the template does not render it")
        first, last = where[0], where[-1]
        if any(owner[order[p - 1]] != index for p in range(first, last + 1)):
            raise RowRejected("turn_not_located", f"turn {index} (assistant): other turns are rendered inside it")
        lo = starts[first - 1]
        previous = order[first - 2] if first > 1 else None
        offset, how = _turn_start(render, marked, tools, index, pattern, previous, pieces[first - 1], shape, real, lo)
        start = lo + offset
        if located is not None:
            located[how] += 1
        lo, hi = starts[last], starts[last] + len(pieces[last])
        if index == len(messages) - 1:
            at = real.find(shape.end, lo, hi) if shape.end else -1
            end = at + len(shape.end) if at >= 0 else hi   # the final turn: its end marker, else the text's end
        elif shape.calls_end_alike and (at := real.find(shape.end, lo, hi)) >= 0:
            end = at + len(shape.end)
        else:
            end = lo + _rendered_end(render, marked, tools, index, f"{base}{order[last - 1]}Q", pieces[last], shape)
        spans.append((start, end))
    return spans


def _turn_start(render: Render, marked: list[dict[str, Any]], tools, index: int, pattern: re.Pattern,
                previous: int | None, piece: str, shape: TemplateShape, real: str, piece_at: int) -> tuple[int, str]:
    """(offset in ``piece``, how it was found): where the model starts writing turn ``index``, ``piece`` being
    the skeleton text before its first marker, after the marker before it (``previous``). Step 4 of the
    module's docstring."""
    bare = ""
    try:
        prompt = render(marked[:index], tools, True)
    except Exception:       # a template that refuses a conversation ending before an assistant turn
        prompt = None
    if prompt is not None:
        tail = after_marker(prompt, pattern, previous)     # the turn's context after `previous`, and the prompt
        if tail is not None and piece.startswith(tail):
            return len(tail), "prompt"  # the piece runs on past the prompt: the rest is the model's
        try:
            bare = render(marked[:index], tools, False)
        except Exception:
            bare = ""
    if prompt is not None and bare and prompt.startswith(bare):
        generation = prompt[len(bare):]
        before = after_marker(bare, pattern, previous)
        how = "prompt"
        if before is not None and piece.startswith(before):
            context = len(before)       # the turn's context renders as in the whole conversation
        else:       # it does not (a tools list or system text put before the last user turn only): anchor the end
            context = context_end(piece, bare, marked[index - 1].get("content") if index else None)
            how = "anchored"
        if context >= 0:
            shared = len(commonprefix([piece[context:], generation]))
            if shared == len(generation) or context + shared == len(piece):
                return context + shared, how    # past the prompt, the rest the model's; or less of it rendered
            while shared > 0 and piece[context + shared - 1] not in BOUNDARY:
                shared -= 1             # parted mid-text (a prompt "<think>" against a call's "<tool_call>")
            # a prompt that writes more before the header than a finished turn (a reminder turn put before the
            # prompt only): the longest end of it, from a line or a special token on, that opens the turn
            ends = (len(generation) - k for k in range(1, len(generation))
                    if (generation[k - 1] == "\n" or any(generation.startswith(t, k) for t in shape.specials))
                    and piece.startswith(generation[k:], context))
            start = context + max(shared, next(ends, 0))
            if start == context and shape.end and piece.startswith(shape.end, context):
                # the turn before, an assistant's, is left open where it ends the conversation (no end marker
                # after the last turn): its end opens the piece, and the prompt's header follows it
                after = context + len(shape.end)
                at = piece.find(generation, after) if generation.strip() else -1
                if at >= 0 and not piece[after:at].strip():
                    return at + len(generation), how
            return start, how
    at = next((at + len(h) for h in shape.headers if (at := piece.rfind(h)) >= 0), -1)
    if at < 0:
        raise RowRejected("turn_not_located", f"turn {index} (assistant): neither the generation prompt rendered "
                                              "after its context nor a role header "
                                              f"({', '.join(repr(h) for h in shape.headers) or 'none learned'}) "
                                              f"lines up before it: {around(real, piece_at + len(piece))}")
    return at, "header"




def _rendered_end(render: Render, marked: list[dict[str, Any]], tools, index: int, last_marker: str,
                  piece: str, shape: TemplateShape) -> int:
    """Length of the part of ``piece`` (the text after turn ``index``'s last marker, up to the next marker)
    that still belongs to the turn: what the template renders after that marker when the conversation
    ends with the turn, as far as it agrees with ``piece``. The template itself says where the turn ends,
    whatever its end token (<|eot_id|>, <|eom_id|> after a call, <|call|>, ...). With no end-of-turn
    marker (``shape.end`` empty), the special token that then opens the next turn is the turn's too."""
    cut = render(marked[:index + 1], tools, False)
    at = cut.rfind(last_marker)
    if at < 0:
        raise RowRejected("turn_not_located", f"turn {index} (assistant): the template does not render it when "
                                              "the conversation ends with it; cannot tell where it ends")
    after = cut[at + len(last_marker):]
    length = agreement(after, piece, shape.specials)
    if (length == len(after) and shape.end and piece.startswith(shape.end, length)
            and not splits_special(piece, length + len(shape.end), shape.specials)):
        length += len(shape.end)    # a last turn left open (no end marker when it ends the text): its end follows
    if not shape.end:
        rest = piece[length:]
        stop = next((s for s in shape.specials if rest.lstrip().startswith(s)), None)
        if stop is None:
            raise RowRejected("turn_not_located", f"turn {index} (assistant): no special token opens the turn after "
                                                  f"it, and the template has no end-of-turn marker: '{escaped(rest[:40])}'")
        return length + len(rest) - len(rest.lstrip()) + len(stop)
    if not piece[:length].strip():
        raise RowRejected("turn_not_located", f"turn {index} (assistant): the template renders nothing after it "
                                              "that it also renders when the turn is last; cannot tell where it ends")
    return length
