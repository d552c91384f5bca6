"""Regenerate the shipped sample sets in hsx_tools/data/ (deterministic).

sample_conversations.jsonl: 160 plain chat rows (the embedded default's dataset), lognormal lengths,
  in both OpenAI (`messages`) and ShareGPT (`conversations`) form.
sample_agentic.jsonl: 40 agentic rows (reasoning, several tool calls, consecutive tool results, with and
  without a system turn and tools; OpenAI and ShareGPT forms), see hsx_tools/samples.py.
Run: python scripts/make_sample_data.py
"""

import json
import random
from pathlib import Path

from hsx_tools.samples import agentic_rows, chat_messages

DATA = Path(__file__).resolve().parents[1] / "hsx_tools" / "data"


def main(count: int = 160, agentic: int = 40, seed: int = 1234) -> None:
    rng = random.Random(seed)
    with open(DATA / "sample_conversations.jsonl", "w") as fh:
        for i in range(count):
            msgs = chat_messages(rng)
            if i % 4 == 3:
                role_map = {"user": "human", "assistant": "gpt", "system": "system"}
                row = {"id": f"conv-{i:04d}", "conversations": [{"from": role_map[m["role"]], "value": m["content"]} for m in msgs]}
            else:
                row = {"id": f"conv-{i:04d}", "messages": msgs}
            fh.write(json.dumps(row) + "\n")
    with open(DATA / "sample_agentic.jsonl", "w") as fh:
        for row in agentic_rows(agentic):
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
