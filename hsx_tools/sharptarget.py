"""A tiny Qwen3 trained until its next-token distribution is sharp, and the patterned rows it was trained on.

A random target has nothing for a drafter to learn; this one has. Each row is pre-tokenised (``input_ids`` +
``loss_mask``, a format `hsx produce` reads): a prompt of filler tokens, one of ``KEYS`` key tokens and a
separator; the answer is the key's own fixed sequence of ``ANSWER_LENGTH`` tokens and the end-of-turn token.
The answer's tokens come from one small alphabet shared by every key, and over the keys each token is followed by
every token once, so a token alone says nothing of the next one: the next tokens depend on the key, far back in
the context, which reaches a drafter only through the target's hidden states. A drafter trained on hidden states that carry
nothing (all zeros) cannot learn the answers, one trained on the real ones can.

Deterministic for a seed; built on the CPU in seconds (``build_sharp_target``), cached by its folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

KEYS = 16
ANSWER_LENGTH = 16
ALPHABET = 17         # prime: every step 1..KEYS walks a cycle without repeating a token
FILLER = 32
FIRST_ID = 64          # alphabet, keys, filler and the separator are ids FIRST_ID... of the tiny tokenizer (512)


def _layout(seed: int) -> dict:
    rng = random.Random(seed)
    alphabet = list(range(FIRST_ID, FIRST_ID + ALPHABET))
    keys = list(range(FIRST_ID + ALPHABET, FIRST_ID + ALPHABET + KEYS))
    filler = list(range(keys[-1] + 1, keys[-1] + 1 + FILLER))
    separator = filler[-1] + 1
    # key k steps through the alphabet by k + 1 (under a random relabelling): over the keys, every token is
    # followed by every token once, so the token alone says nothing of the next one (1 / ALPHABET at best)
    relabel = rng.sample(alphabet, ALPHABET)
    answers = {}
    for k, key in enumerate(keys):
        start = rng.randrange(ALPHABET)
        answers[key] = [relabel[(start + i * (k + 1)) % ALPHABET] for i in range(ANSWER_LENGTH)]
    return {"keys": keys, "filler": filler, "separator": separator, "answers": answers}


def rows(count: int, eos_id: int, seed: int = 0, layout_seed: int = 0) -> list[dict]:
    """``count`` pre-tokenised rows (``id``, ``input_ids``, ``loss_mask``): prompt, answer, eos."""
    layout, rng = _layout(layout_seed), random.Random(seed)
    out = []
    for i in range(count):
        key = layout["keys"][i % KEYS]
        prompt = [rng.choice(layout["filler"]) for _ in range(rng.randint(3, 8))] + [key, layout["separator"]]
        answer = layout["answers"][key] + [eos_id]
        out.append({"id": f"s{seed}-{i}", "input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)})
    return out


def write_rows(path: Path, count: int, eos_id: int, seed: int) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows(count, eos_id, seed=seed)))
    return path


def build_sharp_target(out_dir: Path, num_layers: int = 6, hidden_size: int = 64, steps: int = 300, seed: int = 0) -> Path:
    """Train the tiny Qwen3 on ``rows`` (loss on the answers) for ``steps`` AdamW steps; save it to ``out_dir``.
    ``out_dir/sharp_target.json`` records the settings and the last loss; a folder holding it is reused."""
    import torch

    from hsx_tools.tinymodel import build_tokenizer, random_qwen3

    out_dir = Path(out_dir)
    record = out_dir / "sharp_target.json"
    settings = {"num_layers": num_layers, "hidden_size": hidden_size, "steps": steps, "seed": seed, "keys": KEYS,
                "answers": "latin",
                "answer_length": ANSWER_LENGTH, "alphabet": ALPHABET}
    if record.exists() and json.loads(record.read_text()).get("settings") == settings:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    model = random_qwen3(tokenizer, num_layers, hidden_size, max_positions=4096, seed=seed)
    train = rows(512, tokenizer.eos_token_id, seed=seed + 1000)
    width = max(len(r["input_ids"]) for r in train)
    ids = torch.full((len(train), width), tokenizer.pad_token_id)
    labels = torch.full((len(train), width), -100)
    for i, row in enumerate(train):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.where(torch.tensor(row["loss_mask"]) == 1, torch.tensor(row["input_ids"]), -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    loss = None
    for _ in range(steps):
        pick = torch.randint(0, len(train), (128,), generator=generator)
        loss = model(input_ids=ids[pick], labels=labels[pick]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out_dir)
    record.write_text(json.dumps({"settings": settings, "last_loss": loss.item()}))
    return out_dir
