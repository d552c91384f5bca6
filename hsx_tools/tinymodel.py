"""A tiny random Qwen3 model and a real byte-level BPE tokenizer with a chat template.

Built locally (no model hub) for the embedded default, the tests and the CPU
benchmark. Deterministic for a given seed. The chat template
(data/chatml_thinking_tools.jinja) renders reasoning and tool calls the way the
thinking + tool-calling model families do, and plain conversations as plain ChatML.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

CHAT_TEMPLATE = (resources.files("hsx_tools") / "data" / "chatml_thinking_tools.jinja").read_text()
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_text(sample_path: Path | None) -> list[str]:
    texts = ["system user assistant tool hello world the quick brown fox jumps over the lazy dog 0123456789"]
    if sample_path and sample_path.exists():
        for line in sample_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            for msg in row.get("messages") or row.get("conversations") or []:
                texts.append(str(msg.get("content") or msg.get("value") or ""))
    return texts


def build_tokenizer(out_dir: Path, vocab_size: int = 512, sample_path: Path | None = None,
                    chat_template: str = CHAT_TEMPLATE, special_tokens: tuple[str, ...] = (),
                    eos_token: str = "<|im_end|>", bos_token: str | None = None):
    """``special_tokens``: added to SPECIAL_TOKENS (e.g. another template family's role markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(sample_path), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token="<|endoftext|>",
                                   bos_token=bos_token, unk_token=None)
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(out_dir: Path, num_layers: int = 6, hidden_size: int = 64, seed: int = 0,
                     sample_path: Path | None = None) -> Path:
    """Write a tiny Qwen3 (config + random weights + tokenizer) to ``out_dir``; return it."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        write_weight_index(out_dir)  # a model built by an earlier hsx, without one
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir, sample_path=sample_path)
    model = random_qwen3(tokenizer, num_layers, hidden_size, max_positions=8192, seed=seed)
    model.save_pretrained(out_dir)
    write_weight_index(out_dir)
    return out_dir


def write_weight_index(out_dir: Path) -> None:
    """``model.safetensors.index.json`` beside the single ``model.safetensors``: SpecForge 0.2.0
    reads a target's LM head only through a ``*.index.json`` (real checkpoints are sharded and ship one; its
    TargetHead refuses a folder without: "No index.json file found"). transformers and hsx still read the single
    file; the index maps every tensor to it. Written once (kept if there)."""
    from safetensors import safe_open

    index, weights = out_dir / "model.safetensors.index.json", out_dir / "model.safetensors"
    if index.exists() or not weights.exists():
        return
    with safe_open(str(weights), "pt") as fh:
        weight_map = dict.fromkeys(fh.keys(), weights.name)
    index.write_text(json.dumps({"metadata": {"total_size": weights.stat().st_size}, "weight_map": weight_map},
                                indent=2) + "\n")


def random_qwen3(tokenizer, num_layers: int, hidden_size: int, max_positions: int, seed: int):
    """A tiny Qwen3 (float32, tied embeddings, 4 heads of hidden_size / 4, 2 KV heads) for ``tokenizer``, its weights
    drawn from ``seed``: the model every tiny target here starts from."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
