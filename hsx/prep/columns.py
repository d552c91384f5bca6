"""Column mapping: which dataset columns hold the conversation, and how instruction rows become turns.

Given on the command line (``--columns``) as comma-separated ``key=column`` pairs, several columns of one
role joined by ``+`` (their non-empty values joined by a blank line), or as the path of a JSON file
holding one object with the same keys (a role's value a column name or a list of them):

    --columns user=instruction+input,assistant=output,system=system_prompt
    --columns columns.json        # {"user": ["instruction", "input"], "assistant": "output"}

Keys: messages, conversations, tools, id (rename the column of that field), and system, user, assistant,
reasoning (instruction rows: one system turn if non-empty, one user turn, one assistant turn whose
reasoning_content is the ``reasoning`` columns). Naming ``user`` or ``assistant`` makes every row an
instruction row. Without a mapping, rows holding none of messages / conversations / input_ids are read
through the first INSTRUCTION_PRESETS entry whose required columns are present.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hsx.errors import HsxError

RENAMES = ("messages", "conversations", "tools", "id")
ROLES = ("system", "user", "assistant", "reasoning")


class ColumnMappingError(HsxError, ValueError):
    """The column mapping text or file is malformed; the message says where."""


@dataclass(frozen=True)
class ColumnMapping:
    messages: str = "messages"
    conversations: str = "conversations"
    tools: str = "tools"
    id: str = "id"
    system: tuple[str, ...] = ()
    user: tuple[str, ...] = ()
    assistant: tuple[str, ...] = ()
    reasoning: tuple[str, ...] = ()

    def required(self) -> tuple[str, ...]:
        """Columns that must be present for a preset to apply: the first user and assistant column."""
        return self.user[:1] + self.assistant[:1]

    def describe(self) -> str:
        """The roles it reads, as --columns would spell them: ``system=system_prompt,user=question,...``."""
        return ",".join(f"{role}={'+'.join(getattr(self, role))}" for role in ROLES if getattr(self, role))

    def instruction_columns(self) -> tuple[str, ...]:
        """Every column an instruction row is read from (roles, plus the id and tools columns)."""
        return tuple(c for role in ROLES for c in getattr(self, role)) + (self.id, self.tools)

    def to_dict(self) -> dict[str, Any]:
        """Only what differs from the default (recorded in the run manifest)."""
        default = ColumnMapping()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v != getattr(default, k)}

    @classmethod
    def from_dict(cls, spec: dict[str, Any], where: str = "column mapping") -> ColumnMapping:
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in spec.items():
            if key not in known:
                raise ColumnMappingError(f"{where}: unknown key {key!r} (known: {', '.join(RENAMES + ROLES)})")
            columns = value.split("+") if isinstance(value, str) else value
            if not isinstance(columns, list) or not columns or not all(isinstance(c, str) and c for c in columns):
                raise ColumnMappingError(f"{where}: {key} must name a column (or, for a role, a list of columns)")
            if key in RENAMES:
                if len(columns) != 1:
                    raise ColumnMappingError(f"{where}: {key} renames one column, got {columns}")
                values[key] = columns[0]
            else:
                values[key] = tuple(columns)
        mapping = cls(**values)
        if bool(mapping.user) != bool(mapping.assistant):
            raise ColumnMappingError(f"{where}: instruction rows need both a user and an assistant column")
        return mapping

    @classmethod
    def parse(cls, text: str | None) -> ColumnMapping:
        """``key=col[+col],...`` or the path of a JSON file; None or "" is the default mapping."""
        if not text:
            return cls()
        path = Path(text)
        if "=" not in text and path.suffix == ".json":
            try:
                spec = json.loads(path.read_text())
            except OSError as exc:
                raise ColumnMappingError(f"column mapping file {path}: {exc.strerror}") from None
            except ValueError as exc:
                raise ColumnMappingError(f"column mapping file {path}: not JSON ({exc})") from None
            if not isinstance(spec, dict):
                raise ColumnMappingError(f"column mapping file {path}: want one JSON object")
            return cls.from_dict(spec, where=str(path))
        spec = {}
        for pair in text.split(","):
            key, sep, value = pair.strip().partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ColumnMappingError(f"column mapping {text!r}: {pair!r} is not key=column")
            spec[key.strip()] = value.strip()
        return cls.from_dict(spec, where=f"column mapping {text!r}")


# Instruction layouts read without a mapping, first match wins (required: first user and assistant column).
INSTRUCTION_PRESETS = (
    ColumnMapping(system=("system_prompt",), user=("question",), assistant=("response",)),
    ColumnMapping(system=("system",), user=("instruction", "input"), assistant=("output",)),
    ColumnMapping(user=("problem",), assistant=("solution",)),
)


def preset_for(data: dict[str, Any]) -> ColumnMapping | None:
    """The INSTRUCTION_PRESETS entry a row without a mapping is read through: the first whose required columns
    are present (None: no preset fits)."""
    return next((p for p in INSTRUCTION_PRESETS if all(data.get(c) is not None for c in p.required())), None)
