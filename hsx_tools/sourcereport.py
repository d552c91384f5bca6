"""`hsx inspect` of a mixture: each source's rows, rejects, tokens and shared-prefix share (hsx.prep.mixture).

A mixture's windows hold one source each (``Window.source``), so the tally is by window. Printed after the
whole-mixture lines, one block a source::

    source glaive (glaive.jsonl): 40 rows read, 38 kept, 2 rejected (5.00%): tool_args_not_json 1, glaive_malformed 1
      tokens 12,345 (mean 325 a sample); by format: glaive 40
      shared prefixes: 41.2% of 12,345 tokens (38 rows) lie in a prefix another row shares; ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hsx.prep import TokeniseReport, Window
from hsx.printable import printable
from hsx_tools.prefixshare import prefix_share

PREFIX_SHARE_TOKENS = 5_000_000   # tokens of a source's rows kept for its shared-prefix share


@dataclass
class SourceTally:
    report: TokeniseReport = field(default_factory=TokeniseReport)
    lengths: list[int] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)    # the first PREFIX_SHARE_TOKENS tokens' rows
    kept_tokens: int = 0

    def add(self, window: Window) -> None:
        self.report.merge(window.report)
        for sample in window.samples:
            self.lengths.append(len(sample.input_ids))
            if self.kept_tokens < PREFIX_SHARE_TOKENS:
                self.ids.append(sample.input_ids)
                self.kept_tokens += len(sample.input_ids)


def tally(tallies: dict[str, SourceTally], window: Window) -> None:
    """Count a mixture's window under its source (a single dataset's windows have none: not counted)."""
    if window.source:
        tallies.setdefault(window.source, SourceTally()).add(window)


def source_lines(mixture, tallies: dict[str, SourceTally]) -> list[str]:
    """One block a source of ``mixture`` (hsx.prep.Mixture), in its order; sources no row was read of say so."""
    lines = []
    for source in mixture.sources:
        t = tallies.get(source.name)
        head = f"source {source.name} ({source.path.name})"
        if t is None:
            lines.append(f"{head}: no rows read")
            continue
        rep = t.report
        reasons = ", ".join(f"{code} {n}" for code, n in rep.rejected.most_common())
        lines.append(f"{head}: {rep.rows} rows read, {rep.kept} kept, {rep.rejected_rows} rejected "
                     f"({rep.reject_share():.2%})" + (f": {reasons}" if reasons else ""))
        tokens = sum(t.lengths)
        lines.append(f"  tokens {tokens:,}" + (f" (mean {tokens / len(t.lengths):.0f} a sample)" if t.lengths else "")
                     + "; by format: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.formats.items())))
        if t.ids:
            lines.append("  " + prefix_share(t.ids).line("shared prefixes"))
    return [printable(line) for line in lines]   # names and reasons come from the mixture file and the rows
