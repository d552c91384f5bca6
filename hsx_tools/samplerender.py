"""A sample as `hsx inspect` and `hsx show` print it: runs of tokens in and out of the loss mask, plain with
[[masked]] markers or coloured on a terminal."""

from __future__ import annotations

import numpy as np

from hsx.printable import printable


def sample_segments(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[tuple[str, bool]]:
    """(text, in loss mask) runs of consecutive tokens with the same mask value; the text ``printable`` (its lines
    and tabs kept, every other control character shown as its escape: a row cannot drive the terminal)."""
    segments, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            segments.append((printable(tokenizer.decode(ids[start:i].tolist()), lines=True), bool(mask[start])))
            start = i
    return segments


def render_sample(segments: list[tuple[str, bool]], console=None) -> str | None:
    """Plain text with [[masked]] markers, or (console given) coloured output printed to it."""
    if console is None:
        return "".join(f"[[{text}]]" if masked else text for text, masked in segments)
    from rich.text import Text

    out = Text()
    for text, masked in segments:
        out.append(text, style="bold green" if masked else "dim")
    console.print(out)
    return None
