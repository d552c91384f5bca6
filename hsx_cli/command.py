"""A sub-command: its flags, how a frozen config is built from their values, and ``run(config)``.

Every sub-command module defines one ``COMMAND = Command(...)``; ``hsx_cli.main.COMMANDS``
lists them all. ``config`` receives the resolved flag values (``hsx_cli.flags.resolve``) and
returns the frozen config object the role or tool takes; no argparse ``Namespace`` goes further.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str                                   # one line, in `hsx --help`
    description: str                            # a paragraph, in `hsx NAME --help`
    flags: tuple                                # Flag, ...
    config: Callable[[Mapping[str, object]], object]
    run: Callable[[object], int]
