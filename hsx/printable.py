"""Data made safe to print: control characters from a row, a sample id or an error message are shown, never obeyed.

A dataset row, a sample id, a model's decoded text or a record read from Redis may hold bytes a terminal acts on:
ESC starts an escape sequence (``ESC ] 0 ;`` sets the window title, ``ESC ] 52 ;`` writes the clipboard,
``ESC [ 2 J`` clears the screen), C1 controls (U+0080-U+009F; U+009B is a one-character CSI on many terminals)
do the same, a carriage return or backspace overwrites what was printed, and bidi overrides (U+202A-U+202E,
U+2066-U+2069, ...) reorder what is shown. ``printable`` writes each such character as its escape (``\\x1b``,
``\\x9b``, ``\\u202e``, ``\\r``): the text keeps every other character, and stays readable. Applying it twice changes
nothing. Every place hsx prints data goes through it: show, inspect, status, rejected-row messages, errors, logs.
"""

from __future__ import annotations

import logging
import re

# C0 controls but tab and newline, DEL, C1 controls; ALM, LRM, RLM; line/paragraph separators and the bidi embeddings
# and overrides; the bidi isolates.
_TEXT = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
_IN_TEXT = re.compile(f"[{_TEXT}]")
_IN_LINE = re.compile(f"[\n{_TEXT}]")           # one line: a newline is shown too (no forged log lines)
_NAMED = {"\n": "\\n", "\r": "\\r", "\b": "\\b"}


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def printable(value: object, lines: bool = False) -> str:
    """``str(value)`` with every character a terminal would act on written as its escape. ``lines``: the text is
    several lines (a sample's text), so newlines and tabs stay as they are; else one line (an id, a message, a log
    line): a newline is shown as ``\\n`` too. Tabs stay in both."""
    text = value if isinstance(value, str) else str(value)
    pattern = _IN_TEXT if lines else _IN_LINE
    return pattern.sub(_escape, text) if pattern.search(text) else text


class PrintableFormatter(logging.Formatter):
    """Log lines with their message made ``printable`` (one line); a traceback keeps its lines, each made safe."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei) -> str:
        return printable(super().formatException(ei), lines=True)

    def formatStack(self, stack_info: str) -> str:
        return printable(super().formatStack(stack_info), lines=True)
