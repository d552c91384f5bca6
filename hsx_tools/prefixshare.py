"""The shared-prefix share of a dataset: how many of its tokens lie in a prefix another row also starts with.

Token ids after the template (what the target computes). Agentic and tool-calling data repeat system prompts
and tool lists; one-row-per-turn expansions repeat whole histories. A causal target's hidden states of a
prefix do not depend on what follows it, so each shared prefix could be computed once. Two figures:

- ``shared``: tokens of each row inside the longest prefix it shares with any other row, over all tokens
  (a row whose first k tokens another row also starts with counts k);
- ``saved``: the share of tokens a prefix-reusing extractor would not compute: all tokens minus the nodes of
  the rows' token trie (every distinct prefix computed once).

Both come from the rows sorted by their ids: a row's longest shared prefix is its longest common prefix with
a neighbour in that order, and the trie's size is the sum of each row's length minus its common prefix with
the row before it. O(total tokens) memory, one sort.

    python -m hsx_tools.prefixshare --model MODEL FILE [FILE ...]   # per file and over all files together
    python -m hsx_tools.prefixshare --model MODEL --per-turn OUT.jsonl FILE ...   # + a one-row-per-turn expansion

``--per-turn`` also writes the files' chat rows expanded one row per assistant message (row k: the conversation up
to and including its k-th assistant message, as datasets built for per-turn training are) and measures that.
hsx's own expansion (``hsx produce --per-turn``, hsx/prep/perturn.py) cuts by turns as the template renders
history; ``hsx inspect --per-turn`` measures that one.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class PrefixShare:
    rows: int
    tokens: int
    shared_tokens: int      # tokens in a prefix another row shares
    trie_tokens: int        # distinct prefixes: what computing each shared prefix once costs

    @property
    def shared(self) -> float:
        return self.shared_tokens / self.tokens if self.tokens else 0.0

    @property
    def saved(self) -> float:
        return 1 - self.trie_tokens / self.tokens if self.tokens else 0.0

    def line(self, name: str) -> str:
        return (f"{name}: {self.shared:.1%} of {self.tokens:,} tokens ({self.rows:,} rows) lie in a prefix another "
                f"row shares; computing each shared prefix once would skip {self.saved:.1%}")


@dataclass
class PrefixPrediction:
    """What `hsx produce --prefix-reuse` will plan, window by window (hsx/prep/prefixplan.py): tokens computed."""

    on: bool
    why: str                 # off: why, in words
    token_budget: int
    max_rows: int
    pad_multiple: int
    min_tokens: int
    cache_tokens: int = 0
    forward_tokens: int = 0
    stored_tokens: int = 0   # the most a batch of trees stores (0: the token budget)
    packed: bool = True      # planned for workers that pack rows (--prefix-rows packed)
    computed: int = 0
    batches: int = 0

    @classmethod
    def of(cls, cfg, model_type: str, stored_budgets: int) -> PrefixPrediction:
        from hsx.defaults import DEFAULT_PREFIX_CACHE_BUDGETS
        from hsx.runspec import PREFIX_EXACT_MODEL_TYPES, stored_tokens

        why = ("--prefix-reuse off" if cfg.prefix_reuse == "off" else "" if model_type in PREFIX_EXACT_MODEL_TYPES
               else f"model type {model_type} is not one shown exact")
        return cls(not why, why, cfg.token_budget, cfg.max_batch_rows, cfg.pad_multiple, cfg.prefix_min_tokens,
                   DEFAULT_PREFIX_CACHE_BUDGETS * cfg.token_budget, cfg.prefix_forward_tokens,
                   stored_tokens(stored_budgets, cfg.token_budget), packed=cfg.prefix_rows == "packed")

    def add(self, samples) -> None:
        if self.on:
            from hsx.prep import cut_prefix_batches

            planned = cut_prefix_batches([s.input_ids for s in samples], self.token_budget, self.max_rows,
                                         self.pad_multiple, self.min_tokens, self.cache_tokens, self.forward_tokens,
                                         self.stored_tokens, packed=self.packed)
            self.computed += sum(b.computed for b in planned)
            self.batches += len(planned)

    def line(self, stored: int, padded: int) -> str:
        if not self.on:
            return f"  shared prefixes: off ({self.why}): {stored:,} tokens stored, {padded:,} computed"
        return (f"  shared prefixes (--prefix-reuse auto, spines of >= {self.min_tokens} tokens, "
                f"{self.forward_tokens} tokens a forward, rows {'packed' if self.packed else 'padded'}"
                f"{self._stored_said()}): {stored:,} tokens "
                f"stored, {self.computed:,} computed in {self.batches:,} batches ({padded / max(self.computed, 1):.2f}x "
                f"fewer than the {padded:,} of --prefix-reuse off)")

    def _stored_said(self) -> str:
        return f", {self.stored_tokens:,} stored a batch" if self.stored_tokens else ""


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def prefix_share(sequences: list[np.ndarray]) -> PrefixShare:
    """The figures over ``sequences`` (token ids of each row, any integer dtype)."""
    seqs = [np.asarray(s, dtype=">u4") for s in sequences]   # big-endian: bytes order = token order
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].tobytes())
    lcp_prev = [0] * len(order)
    for k in range(1, len(order)):
        lcp_prev[k] = _common(seqs[order[k - 1]], seqs[order[k]])
    tokens = sum(len(s) for s in seqs)
    shared = sum(max(lcp_prev[k], lcp_prev[k + 1] if k + 1 < len(order) else 0) for k in range(len(order)))
    trie = sum(len(seqs[i]) - lcp_prev[k] for k, i in enumerate(order))
    return PrefixShare(len(seqs), tokens, shared, trie)


def tokenise_file(dataset: Path, model: str, max_length: int = 32768, template_kwargs: dict | None = None,
                  workers: int = 1, per_turn: bool = False) -> list[np.ndarray]:
    """The kept samples' token ids, as `hsx produce` tokenises them (overlong rows truncated; ``per_turn``: one
    sample a turn, as `hsx produce --per-turn` makes them)."""
    from hsx.prep import TokeniseSettings, WindowTokeniser

    settings = TokeniseSettings(model, max_length, "truncate", template_kwargs or {}, None, per_turn=per_turn)
    out: list[np.ndarray] = []
    with WindowTokeniser(Path(dataset), settings, workers, 20_000) as windows:
        for window in windows:
            out += [s.input_ids for s in window.samples]
    return out


def expand_per_turn(files: list[Path], out: Path) -> int:
    """Write ``out``: each `messages` / `conversations` row of ``files`` once per assistant turn, cut after that
    turn (ids ``<id>-t<k>``); other rows are left out. Returns the rows written."""
    import json

    from hsx.prep import Row, iter_rows

    written = 0
    with open(out, "w") as fh:
        for f in files:
            for item in iter_rows(f):
                if not isinstance(item, Row):
                    continue
                data = item.data
                key, role_key, assistant = (("messages", "role", "assistant") if data.get("messages") is not None
                                            else ("conversations", "from", "gpt"))
                turns = data.get(key)
                if not isinstance(turns, list):
                    continue
                ends = [i for i, t in enumerate(turns) if isinstance(t, dict) and t.get(role_key) == assistant]
                for k, end in enumerate(ends):
                    row = dict(data, **{key: turns[:end + 1]}, id=f"{data.get('id', item.index)}-t{k}")
                    fh.write(json.dumps(row) + "\n")
                    written += 1
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hsx_tools.prefixshare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model folder or hub id (its tokenizer and chat template)")
    ap.add_argument("--max-length", type=int, default=32768)
    ap.add_argument("--per-turn", type=Path, help="also write the files' rows one per assistant turn here, and measure it")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    missing = [str(f) for f in args.files if not f.exists()]
    if missing:
        print(f"prefixshare: no such dataset: {', '.join(missing)}", file=sys.stderr)
        return 2
    every: list[np.ndarray] = []
    for f in args.files:
        seqs = tokenise_file(f, args.model, args.max_length)
        every += seqs
        print(prefix_share(seqs).line(f.name))
    if len(args.files) > 1:
        print(prefix_share(every).line("all files together"))
    if args.per_turn:
        rows = expand_per_turn(args.files, args.per_turn)
        print(prefix_share(tokenise_file(args.per_turn, args.model, args.max_length)).line(
            f"{args.per_turn.name} (one row per assistant turn, {rows:,} rows)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
