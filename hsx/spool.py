"""The local spool: finished batch files waiting for their upload, and its byte budget."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TMP_MARK = ".tmp-"  # <batch>.safetensors.tmp-<writer's worker name>: a write in progress


@dataclass(frozen=True)
class SpoolUsage:
    files: int
    bytes: int


def usage(spool_dir: Path) -> SpoolUsage:
    """Complete batch files and their bytes, over every run under ``spool_dir``."""
    files = total = 0
    root = Path(spool_dir)
    if not root.exists():
        return SpoolUsage(0, 0)
    for run_dir in os.scandir(root):
        if not run_dir.is_dir():
            continue
        for entry in os.scandir(run_dir.path):
            if entry.name.endswith(".safetensors"):
                try:
                    total += entry.stat().st_size
                    files += 1
                except FileNotFoundError:  # uploaded and removed meanwhile
                    pass
    return SpoolUsage(files, total)


def complete_files(spool_dir: Path, run: str) -> list[Path]:
    d = Path(spool_dir) / run
    return sorted(d.glob("*.safetensors")) if d.exists() else []


def temp_files(spool_dir: Path, run: str) -> dict[Path, str]:
    """Temp files of ``run`` -> the tag (writer's worker name) in their name."""
    d = Path(spool_dir) / run
    if not d.exists():
        return {}
    return {p: p.name.split(TMP_MARK, 1)[1] for p in sorted(d.iterdir()) if TMP_MARK in p.name}
