"""Which columns instruction rows are read from, and which they leave out (`hsx inspect`).

A row holding none of messages / conversations / input_ids is read through ``--columns`` or, without it, the
first INSTRUCTION_PRESETS entry that fits (hsx/prep/columns.py). Either way every other column of the row is
ignored; this says which mapping was chosen and which non-empty columns it left out, so that a dataset's
``thoughts`` or ``system_prompt`` is not dropped without a word.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hsx.prep import ColumnMapping, Row, iter_rows, preset_for

SCAN_ROWS = 20_000   # rows read for this report (a JSON parse each, no tokenising)
CONVERSATION_KEYS = ("input_ids",)


@dataclass
class MappingUse:
    mapping: ColumnMapping
    given: bool                 # --columns (else a built-in preset)
    rows: int = 0
    left_out: Counter = field(default_factory=Counter)   # column -> rows where it held a value and was ignored


def _empty(value) -> bool:
    return value is None or value == "" or value == [] or value == {}


def column_use(dataset: Path, mapping: ColumnMapping | None, max_rows: int = SCAN_ROWS) -> tuple[list[MappingUse], int]:
    """(the mappings instruction rows were read through, with their left-out columns; rows scanned)."""
    mapping = mapping or ColumnMapping()
    given = bool(mapping.user or mapping.assistant)
    uses: dict[str, MappingUse] = {}
    scanned = 0
    for item in iter_rows(dataset):
        if scanned >= max_rows:
            break
        scanned += 1
        if not isinstance(item, Row):
            continue
        data = item.data
        if given:
            chosen = mapping
        elif any(data.get(k) is not None for k in (mapping.messages, mapping.conversations, *CONVERSATION_KEYS)):
            continue
        elif (chosen := preset_for(data)) is None:
            continue
        use = uses.setdefault(chosen.describe(), MappingUse(chosen, given))
        use.rows += 1
        read = set(chosen.instruction_columns())
        use.left_out.update(c for c, v in data.items() if c not in read and not _empty(v))
    return list(uses.values()), scanned


def column_lines(uses: list[MappingUse], scanned: int, max_rows: int = SCAN_ROWS) -> list[str]:
    where = f" (of the first {scanned:,} rows)" if scanned >= max_rows else ""
    lines = []
    for use in uses:
        how = "--columns" if use.given else "the built-in preset (no --columns given)"
        lines.append(f"  instruction rows: {use.rows:,}{where} read through {how} {use.mapping.describe()}")
        if use.left_out:
            left = ", ".join(f"{c} ({n:,} rows)" for c, n in use.left_out.most_common())
            lines.append(f"    columns left out (not in any turn): {left}; to use one, map it: --columns "
                         f"{use.mapping.describe()},reasoning=COLUMN (or system=, user=A+B)")
        else:
            lines.append("    no column left out")
    return lines
