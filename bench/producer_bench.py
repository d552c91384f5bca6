"""Producer benchmark: tokenising rows/s per core, time to first enqueue, and the 1M-row projection.

Not a test. Builds a byte-level BPE tokenizer of realistic vocabulary (32k by
default) with the `tokenizers` library, trained on generated text, gives it a
chat template of the thinking + tools kind (reasoning kept only after the last
user turn, tool calls inside the assistant turn, tool results in a user turn,
tools in the system turn), generates multi-turn rows (single-turn, chat and
agentic; mean ~850 tokens) and measures:

1. rows/s of the window tokeniser (template + tokenizer + loss mask) with 1 and
   with N processes (per core = rows/s / N);
2. with --produce: a real `produce` (private redis-server, local store) with
   small windows: seconds from start to the first job on the queue;
3. the drift check: seconds per block of rows in one process, first vs last
   block (the landed code slowed from 23.3 to 30.7 s per 10k rows).

    .venv/bin/python bench/producer_bench.py --rows 20000 --workers 2 --produce
    (writes bench-out/producer.json; prints a summary and the projection)

Projection for R rows on C cores: R / (C x rows/s per core); first enqueue at
D cores with W-row windows: process start + W / (D x rows/s per core) +
the measured plan/write/enqueue time of one window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>", "<tools>", "</tools>"]

# Written for this benchmark (no model's file copied): behaves like the thinking + tools families.
TEMPLATE = """{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools or (messages and messages[0].role == 'system') -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}

You may call these tools:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>{% endif %}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- elif m.role == 'user' -%}
<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if loop.index0 > ns.last_user and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for c in (m.tool_calls or []) %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""


class TextGen:
    """Synthetic language: a Zipf-distributed vocabulary of made-up words, plus code and JSON."""

    def __init__(self, seed: int, words: int = 40_000):
        rng = random.Random(seed)
        syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"] + ["th", "st", "ing", "er", "an"]
        self.words = list({"".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4))))
                           for _ in range(words)})
        self.cum_weights = list(itertools.accumulate(1 / (i + 1) for i in range(len(self.words))))   # Zipf
        self.rng = rng

    def sentence(self, n: int) -> str:
        words = self.rng.choices(self.words, cum_weights=self.cum_weights, k=n)
        return (" ".join(words).capitalize() + self.rng.choice(".?!.")).replace(" ,", ",")

    def paragraph(self, tokens: int) -> str:
        out, total = [], 0
        while total < tokens:
            n = self.rng.randint(6, 24)
            out.append(self.sentence(n))
            total += int(n * 1.5)
        return " ".join(out)

    def code(self, lines: int) -> str:
        w = self.rng.choice
        body = [f"    {w(self.words)}_{i} = {w(self.words)}({w(self.words)}, {self.rng.randint(0, 999)})"
                for i in range(lines)]
        return f"def {w(self.words)}({w(self.words)}, {w(self.words)}):\n" + "\n".join(body) + "\n    return None"


def tool_spec(gen: TextGen, name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": gen.sentence(12),
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
                           "required": ["path"]}}}


def make_row(gen: TextGen, i: int) -> dict:
    rng = gen.rng
    kind = rng.choices(("single", "chat", "agentic"), (0.3, 0.3, 0.4))[0]
    size = min(rng.lognormvariate(5.25, 0.7), 2000)     # words of prose: rows of mean ~850 tokens
    if kind == "single":
        msgs = [{"role": "user", "content": gen.paragraph(size * 0.3)},
                {"role": "assistant", "content": gen.paragraph(size * 0.7)}]
        return {"id": f"r{i}", "messages": msgs}
    if kind == "chat":
        msgs = [{"role": "system", "content": gen.sentence(20)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(2, 4)):
            msgs += [{"role": "user", "content": gen.paragraph(size * 0.1)},
                     {"role": "assistant", "content": gen.paragraph(size * 0.25)}]
        return {"id": f"r{i}", "messages": msgs}
    names = [f"{gen.rng.choice(gen.words)}_{k}" for k in range(rng.randint(2, 5))]
    msgs = [{"role": "system", "content": gen.sentence(25)}, {"role": "user", "content": gen.paragraph(size * 0.15)}]
    for step in range(rng.randint(1, 3)):
        calls = [{"id": f"c{step}{k}", "type": "function", "function": {
            "name": rng.choice(names), "arguments": json.dumps({"path": f"src/{rng.choice(gen.words)}.py",
                                                               "query": gen.sentence(6)})}}
            for k in range(rng.randint(1, 2))]
        msgs.append({"role": "assistant", "content": "", "reasoning_content": gen.paragraph(size * 0.1),
                     "tool_calls": calls})
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
                         "content": gen.code(rng.randint(3, 12))})
    msgs.append({"role": "assistant", "reasoning_content": gen.paragraph(size * 0.1), "content": gen.paragraph(size * 0.3)})
    return {"id": f"r{i}", "messages": msgs, "tools": [tool_spec(gen, n) for n in names]}


def build_tokenizer(out: Path, vocab: int, seed: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config

    if (out / "tokenizer.json").exists():
        return out
    gen = TextGen(seed + 1)
    corpus = [gen.paragraph(400) for _ in range(3000)] + [gen.code(20) for _ in range(800)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    Qwen3Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16).save_pretrained(out)
    return out


def make_rows(path: Path, n: int, seed: int) -> Path:
    if path.exists() and sum(1 for _ in open(path)) == n:
        return path
    gen = TextGen(seed)
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps(make_row(gen, i)) + "\n")
    return path


def time_tokenise(model: Path, rows: Path, workers: int, block: int, hold: bool = False) -> dict:
    """rows/s over the whole file; per-block seconds (drift); the first block includes starting the processes.

    ``hold``: keep every sample until the end, as the landed producer did (whole dataset in memory)."""
    from hsx.prep.windows import TokeniseSettings, WindowTokeniser

    settings = TokeniseSettings(str(model), max_length=32768, overlong="drop")
    start = time.perf_counter()
    blocks, tokens, kept, rows_done, held = [], 0, 0, 0, []
    with WindowTokeniser(rows, settings, workers, window_rows=block) as windows:
        ready = time.perf_counter()
        last = ready
        for window in windows:
            now = time.perf_counter()
            blocks.append(round(now - last, 2))
            last = now
            rows_done += window.report.rows
            kept += window.report.kept
            tokens += sum(len(s.input_ids) for s in window.samples)
            if hold:
                held.extend(window.samples)
            rejected = dict(window.report.rejected)
    total = time.perf_counter() - start
    return {"workers": workers, "hold": hold, "rows": rows_done, "kept": kept, "rejected_last_window": rejected,
            "mean_tokens": tokens / max(kept, 1), "seconds": round(total, 1),
            "rows_per_s": round(rows_done / total, 1), "rows_per_s_per_core": round(rows_done / total / workers, 1),
            "block_rows": block, "block_seconds": blocks}


def time_first_enqueue(model: Path, rows: Path, workers: int, window_rows: int, scratch: Path) -> dict:
    from hsx.redisconn import LocalRedis
    from hsx.runspec.config import ProduceConfig, StoreSettings
    from producer.produce import produce

    shutil.rmtree(scratch, ignore_errors=True)   # a fresh run each time: no manifest, plan or inputs left over
    server = LocalRedis(scratch / "redis").start()
    try:
        marks = {}
        start = time.perf_counter()

        def note(name, window):
            marks.setdefault(f"{name}_{window}", round(time.perf_counter() - start, 2))

        cfg = ProduceConfig(run="bench", dataset=rows, model=str(model), layers="dflash:3",
                            store=StoreSettings(url=str(scratch / "store")), redis_url=server.url, token_budget=32768,
                            max_length=8192, overlong="drop", max_batch_rows=512, pad_multiple=8, dtype="bfloat16",
                            batches_per_shard=1000, tokenise_workers=workers, window_rows=window_rows)
        report = produce(cfg, on_event=note)
        total = time.perf_counter() - start
    finally:
        server.stop()
    return {"workers": workers, "window_rows": window_rows, "first_enqueue_s": marks.get("enqueued_0"),
            "first_tokenised_s": marks.get("tokenised_0"), "total_s": round(total, 1), "batches": report.batches,
            "padding": round(1 - report.tokens / report.padded_tokens, 4), "marks": marks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--workers", type=int, nargs="+", default=[os.cpu_count()], help="process counts to time")
    p.add_argument("--first-window", type=int, default=20_000, help="window of the multi-process runs: its first "
                   "block is the time to the first window (the default window size)")
    p.add_argument("--hold", action="store_true", help="the 1-process run holds every sample until the end, as the "
                   "landed producer did (drift check)")
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--block", type=int, default=2_000, help="rows a timed block (drift check)")
    p.add_argument("--single-rows", type=int, default=0, help="rows of the 1-process run (default: all)")
    p.add_argument("--produce", action="store_true", help="also time a real produce to its first enqueue")
    p.add_argument("--window-rows", type=int, default=5_000, help="window of the timed produce")
    p.add_argument("--out", default=str(ROOT / "bench-out"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_tokenizer(out / f"bpe{args.vocab // 1000}k", args.vocab, seed=7)
    built = time.perf_counter() - t0
    rows = make_rows(out / f"rows{args.rows}.jsonl", args.rows, seed=11)
    single_rows = rows
    if args.single_rows and args.single_rows < args.rows:
        single_rows = out / f"rows{args.rows}-head{args.single_rows}.jsonl"
        with open(rows) as src, open(single_rows, "w") as dst:
            for _, line in zip(range(args.single_rows), src, strict=False):
                dst.write(line)
    result = {"vocab": args.vocab, "tokenizer_build_s": round(built, 1), "cpu_count": os.cpu_count(),
              "one": time_tokenise(model, single_rows, 1, args.block, hold=args.hold)}
    print(json.dumps(result["one"]), flush=True)
    for n in sorted(set(args.workers)):
        if n > 1:
            result[f"many{n}"] = time_tokenise(model, rows, n, args.first_window)
            print(json.dumps(result[f"many{n}"]), flush=True)
            result["many"] = result[f"many{n}"] if n == 8 or "many" not in result else result["many"]
    if args.produce:
        result["produce"] = time_first_enqueue(model, rows, max(args.workers), args.window_rows, out / "produce-scratch")
    per_core = result["one"]["rows_per_s"]
    many = result.get("many", result["one"])
    result["projection_1M_8_cores_s"] = round(1_000_000 / (8 * many["rows_per_s_per_core"]), 0)
    (out / "producer.json").write_text(json.dumps(result, indent=2))
    blocks = result["one"]["block_seconds"]
    print(f"1 process: {per_core} rows/s (mean {result['one']['mean_tokens']:.0f} tokens/sample); "
          f"{many['workers']} processes: {many['rows_per_s']} rows/s = {many['rows_per_s_per_core']} rows/s per core; "
          f"first window of {args.first_window} rows after {many['block_seconds'][0]} s; "
          f"drift: first block {blocks[0]} s, last {blocks[-1]} s; "
          f"1M rows on 8 cores: {result['projection_1M_8_cores_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
