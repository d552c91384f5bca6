"""Regenerate hsx_tools/data/sample_conversations.jsonl (the embedded default's dataset).

Synthetic, deterministic conversations with a realistic spread of lengths
(lognormal), in both OpenAI (`messages`) and ShareGPT (`conversations`) form.
Run: python scripts/make_sample_data.py
"""

import json
import random
from pathlib import Path

WORDS = ("the a model token layer hidden state draft target speculative decoding batch queue worker "
         "upload store ledger redis python tensor gradient attention head residual norm weight shard "
         "question answer explain why how what when where because therefore however example code "
         "function value list number sum loop return print data file read write fast slow memory").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def main(count: int = 160, seed: int = 1234) -> None:
    rng = random.Random(seed)
    out = Path(__file__).resolve().parents[1] / "hsx" / "data" / "sample_conversations.jsonl"
    with open(out, "w") as fh:
        for i in range(count):
            turns = rng.choice([1, 1, 2, 3])
            msgs = []
            if rng.random() < 0.3:
                msgs.append({"role": "system", "content": "You are a helpful assistant."})
            for _ in range(turns):
                msgs.append({"role": "user", "content": sentence(rng, max(3, int(rng.lognormvariate(2.5, 0.6))))})
                msgs.append({"role": "assistant", "content": sentence(rng, max(3, int(rng.lognormvariate(3.6, 0.8))))})
            if i % 4 == 3:
                role_map = {"user": "human", "assistant": "gpt", "system": "system"}
                row = {"id": f"conv-{i:04d}", "conversations": [{"from": role_map[m["role"]], "value": m["content"]} for m in msgs]}
            else:
                row = {"id": f"conv-{i:04d}", "messages": msgs}
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
