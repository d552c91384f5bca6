"""Per-row cost of tokenising with the loss mask (hsx.prep.tokenise.ChatTokeniser), one process, one core.

Counts template renders per row and splits the time into the template renders, the mask placement
(markers, alignment, spans -> token mask) and the tokenizer call. Rows: the generated agentic rows
(hsx_tools.samples) and the shipped chat sample set. Tokenizer: the tiny model's byte-level BPE (vocabulary
512) with the ChatML thinking + tools template, or --model PATH for a real one (its own template).

    .venv/bin/python bench/tokenise_cost.py [--rows 300] [--model PATH] [--template-kwargs enable_thinking=false]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from hsx.prep.tokenise import ChatTokeniser, parse_template_kwargs
from hsx_tools.demo import sample_dataset
from hsx_tools.samples import agentic_rows
from hsx_tools.tinymodel import build_tokenizer


class Timed:
    """Wraps a callable, adding up its calls and seconds."""

    def __init__(self, fn):
        self.fn, self.calls, self.seconds = fn, 0, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - start


def measure(chat: ChatTokeniser, rows: list[dict]) -> dict:
    render, encode = Timed(chat.render), Timed(chat._encode)
    chat.render, chat._encode = render, encode          # instance attributes shadow the methods
    tokens, start = 0, time.perf_counter()
    try:
        for index, row in enumerate(rows):
            tokens += len(chat.encode_row(row, index).input_ids)
    finally:
        del chat.render, chat._encode
    total = time.perf_counter() - start
    n = len(rows)
    return {"rows": n, "tokens_per_row": round(tokens / n), "renders_per_row": round(render.calls / n, 2),
            "ms_per_row": round(1000 * total / n, 2), "render_ms": round(1000 * render.seconds / n, 2),
            "tokenizer_ms": round(1000 * encode.seconds / n, 2),
            "mask_and_rest_ms": round(1000 * (total - render.seconds - encode.seconds) / n, 2),
            "rows_per_s": round(n / total, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300, help="agentic rows to generate")
    parser.add_argument("--model", help="a model folder or hub id whose tokenizer and template to use")
    parser.add_argument("--template-kwargs", default="", help="e.g. enable_thinking=false")
    args = parser.parse_args()
    if args.model:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = build_tokenizer(Path(tempfile.mkdtemp()), sample_path=sample_dataset())
    chat = ChatTokeniser(tokenizer, template_kwargs=parse_template_kwargs(args.template_kwargs))
    sets = {"agentic": agentic_rows(args.rows, seed=9),
            "chat": [json.loads(line) for line in sample_dataset().read_text().splitlines()]}
    for name, rows in sets.items():
        measure(chat, rows[:20])                                    # warm-up: template compile, caches
        print(json.dumps({"set": name, **measure(chat, rows)}))


if __name__ == "__main__":
    main()
