"""A tiny Qwen3 trained until its next-token distribution is sharp, and the patterned rows it was trained on.

A random target has nothing for a drafter to learn; this one has. Each row is pre-tokenised (``input_ids`` +
``loss_mask``, a format `hsx produce` reads): a prompt of filler tokens, one of ``KEYS`` key tokens and a
separator; the answer is the key's own fixed sequence of ``ANSWER_LENGTH`` tokens and the end-of-turn token.
The answer's tokens come from one small alphabet shared by every key, and over the keys each token is followed by
every token once, so a token alone says nothing of the next one: the next tokens depend on the key, far back in
the context, which reaches a drafter only through the target's hidden states. A drafter trained on hidden states that carry
nothing (all zeros) cannot learn the answers, one trained on the real ones can.

Deterministic for a seed on one CPU kind (``build_sharp_target`` pins its thread count and torch's deterministic
algorithms: the same weights at any load, whatever threads the caller runs); another CPU's kernels round
otherwise, so its weights differ and figures measured on the target are compared relative to each other, never
to one machine's numbers. Built on the CPU in minutes; cached in a folder named by ``build_key`` (the builder's
code and settings).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

KEYS = 16
ANSWER_LENGTH = 16
ALPHABET = 17         # prime: every step 1..KEYS walks a cycle without repeating a token
FILLER = 32
FIRST_ID = 64          # alphabet, keys, filler and the separator are ids FIRST_ID... of the tiny tokenizer (512)
BUILD_THREADS = 1      # torch threads of the build: a thread count changes the float sums, so it is part of the build
SHARP_LOSS = 0.01      # trained until the mean loss over the training rows' answers is at most this (nats a token)
CHECK_EVERY = 25       # steps between two looks at that loss (and at the answers' greedy accuracy)
MAX_STEPS = 1500


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


def _settings(num_layers: int, hidden_size: int, max_steps: int, seed: int, threads: int) -> dict:
    return {"num_layers": num_layers, "hidden_size": hidden_size, "max_steps": max_steps, "seed": seed,
            "threads": threads, "sharp_loss": SHARP_LOSS, "check_every": CHECK_EVERY, "keys": KEYS, "answers": "latin",
            "answer_length": ANSWER_LENGTH, "alphabet": ALPHABET}


def build_key(num_layers: int = 6, hidden_size: int = 64, max_steps: int = MAX_STEPS, seed: int = 0,
              threads: int = BUILD_THREADS) -> str:
    """16 hex digits naming one build: SHA-256 over the settings, the source of this module and of
    hsx_tools/tinymodel.py (the code that builds it), and torch's and transformers' versions."""
    import torch
    import transformers

    here = Path(__file__).resolve()
    digest = hashlib.sha256(json.dumps(_settings(num_layers, hidden_size, max_steps, seed, threads), sort_keys=True).encode())
    for source in (here, here.with_name("tinymodel.py")):
        digest.update(source.read_bytes())
    digest.update(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _pinned(threads: int):
    """torch with ``threads`` intra-op threads and deterministic algorithms inside; the caller's settings after."""
    import torch

    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


def build_sharp_target(out_dir: Path, num_layers: int = 6, hidden_size: int = 64, max_steps: int = MAX_STEPS,
                       seed: int = 0, threads: int = BUILD_THREADS) -> Path:
    """Train the tiny Qwen3 on ``rows`` (loss on the answers), on ``threads`` torch threads with deterministic
    algorithms, until it is sharp: every answer token of the training rows is its greedy next token and their mean
    loss is at most SHARP_LOSS (looked at every CHECK_EVERY AdamW steps), or for ``max_steps``; save it to
    ``out_dir``. ``out_dir/sharp_target.json`` records the settings, ``build_key``, the steps taken, the loss, the
    answers' greedy accuracy and whether it is ``sharp``; a folder whose record matches is reused. A fixed step
    count left builds of other seeds or thread counts at losses 0.001-0.1, and a drafter has less to learn from a
    target whose greedy answers are not the data's. Built in a folder beside ``out_dir`` and renamed into place, so
    a build stopped half way, or one racing another process's, leaves no half target (a killed build's folder is
    removed by the next build)."""
    out_dir = Path(out_dir)
    settings = _settings(num_layers, hidden_size, max_steps, seed, threads)
    key = build_key(num_layers, hidden_size, max_steps, seed, threads)

    def built(folder: Path) -> bool:
        path = folder / "sharp_target.json"
        return path.exists() and json.loads(path.read_text()).get("key") == key

    if built(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(out_dir)
    work = out_dir.with_name(f".{out_dir.name}.{os.getpid()}")
    try:
        with _pinned(threads):
            trained = _train(work, settings)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    (work / "sharp_target.json").write_text(json.dumps({"settings": settings, "key": key, **trained}))
    if not built(out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)   # an older build (other code or settings)
        with contextlib.suppress(OSError):           # fails only where another process renamed its build first
            os.rename(work, out_dir)
    shutil.rmtree(work, ignore_errors=True)
    if not built(out_dir):
        raise RuntimeError(f"the sharp target's build did not land in {out_dir}")
    return out_dir


def _remove_dead_builds(out_dir: Path) -> None:
    """The work folders (``.<name>.<pid>``) of builds of ``out_dir`` whose process is gone."""
    for folder in out_dir.parent.glob(f".{out_dir.name}.*"):
        pid = folder.name.rsplit(".", 1)[1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:   # alive, another user's
            pass


def _train(out_dir: Path, settings: dict) -> dict:
    import torch

    from hsx_tools.tinymodel import build_tokenizer, random_qwen3

    seed = settings["seed"]
    out_dir.mkdir(parents=True)
    tokenizer = build_tokenizer(out_dir)
    model = random_qwen3(tokenizer, settings["num_layers"], settings["hidden_size"], max_positions=4096, seed=seed)
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

    def look() -> dict:   # the whole training set: mean answer loss, and the share of answer tokens predicted greedily
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
        model.train()
        predicted, wanted = out.logits[:, :-1].argmax(-1), labels[:, 1:]
        accuracy = (predicted == wanted)[wanted != -100].float().mean().item()
        return {"loss": out.loss.item(), "answer_accuracy": accuracy,
                "sharp": out.loss.item() <= settings["sharp_loss"] and accuracy == 1.0}

    model.train()
    seen, steps = {"sharp": False}, 0
    while steps < settings["max_steps"] and not seen["sharp"]:
        pick = torch.randint(0, len(train), (128,), generator=generator)
        loss = model(input_ids=ids[pick], labels=labels[pick]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
        if steps % settings["check_every"] == 0 or steps == settings["max_steps"]:
            seen = look()
    model.eval()
    model.save_pretrained(out_dir)
    return {"steps": steps, **seen}
