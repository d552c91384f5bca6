"""One sample per assistant turn (``--per-turn``): every turn trained as the model generated it.

Templates that rewrite history (Qwen3's drops the reasoning of every turn before the last user message) render
an earlier turn otherwise than the model wrote it, so a whole conversation as one sample trains only its last
turn as generated. With ``--per-turn`` a row becomes one sample a turn, the template's own rules deciding what
a turn is and how history renders:

- **Turn.** A run of assistant messages (with the tool results between them) that the template renders, in
  the rest of the conversation, exactly as it renders them when the conversation ends with them. Assistant
  message i ends a turn when the rendering of the conversation cut after i is not a prefix (text, no
  generation prompt) of the rendering cut after the next assistant message. So with a Qwen-style template the
  tool-call steps answering one user message and the answer after them are one turn (they keep their
  reasoning until the next user message), and each user message opens another; with a template that keeps
  every turn's reasoning the whole conversation is one turn (the sample is the whole row: ``--per-turn`` adds
  nothing, and ``hsx inspect`` says so); with one that renders reasoning on the last message only, every
  assistant message is a turn. An EOS a template writes after a whole conversation only (Phi-3 style) does
  not count.
- **Sample j** is the conversation up to and including turn j's last assistant message, rendered whole by the
  template (ids = ``apply_chat_template`` of that cut conversation). Messages after the row's last assistant
  message are not rendered: they train nothing, and a trailing user message would make a Qwen-style template
  drop the last turn's reasoning.
- **Its loss mask** covers turn j's assistant messages only (located as hsx/prep/mask.py locates any turn).
  Earlier turns are context: each is in the mask of its own sample, where it renders as generated, while here
  it may render otherwise (without its reasoning: not what the model wrote). Every assistant message is
  trained once over the expanded set.
- **Its id** is ``<row id>#t<j>``, j counting the row's turns from 0 (a pre-tokenised row is one turn, ``#t0``).
  j has digits only, so an id splits back at its last ``#t`` into one (row id, turn): distinct row ids give
  distinct sample ids, whatever the row ids hold.

A row one of whose samples cannot be made (the template refuses a cut conversation, a turn is not located) is
rejected whole, with the reason it would get without ``--per-turn``. Cost: one render per assistant message,
then a row's encode (hsx/prep/tokenise.py) per turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SEPARATOR = "#t"


def turn_id(row_id: str, turn: int) -> str:
    """The sample id of a row's turn ``turn`` (0-based)."""
    return f"{row_id}{SEPARATOR}{turn}"


def split_turn_id(sample_id: str) -> tuple[str, int] | None:
    """(row id, turn) of a per-turn sample id; None when it is not one."""
    row_id, sep, turn = sample_id.rpartition(SEPARATOR)
    return (row_id, int(turn)) if sep and turn.isdigit() and turn.isascii() else None


def turns(messages: list[dict[str, Any]], tools, render: Callable[..., str], eos: str | None = None) -> list[range]:
    """The message indexes of each turn of a conversation in normal form (the messages as the template gets
    them), in order: turn j is ``range(start, stop)``, ``stop - 1`` its last assistant message, ``start`` one
    past the previous turn's (0 for the first). Messages after the last assistant message are in no turn.
    ``render(messages, tools, add_generation_prompt)`` renders (RowRejected where the template refuses).
    ``eos``: the tokenizer's EOS, which a template may write after a whole conversation only (Phi-3 style:
    the model stopped at its turn's own end marker before it); a cut rendering that ends with it is a prefix
    without it."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    cut = [render(messages[:i + 1], tools, False) for i in assistants]

    def alike(text: str, later: str) -> bool:
        if later.startswith(text):
            return True
        return bool(eos and eos.strip()) and text.endswith(eos) and later.startswith(text[:len(text) - len(eos)])

    ends = [i for i, text, later in zip(assistants, cut, [*cut[1:], None], strict=True)
            if later is None or not alike(text, later)]
    return [range(start, end + 1) for start, end in zip([0, *(e + 1 for e in ends[:-1])], ends, strict=True)]
