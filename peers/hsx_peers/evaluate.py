"""A SpecForge 0.2.0 DFlash drafter measured against its target: real greedy speculative decoding, and a
teacher-forced figure from an hsx run's stored hidden states. Runs where SpecForge is installed (its venv);
`hsx evaluate` drives it as a subprocess and reads the JSON report it prints last.

    python -m hsx_peers.evaluate --target DIR --drafter CKPT [--draft-config JSON] --request request.json

``--drafter``: a checkpoint as ``specforge train`` writes it (a ``<run_id>-step<N>`` folder, its
``training_state.pt``, or the output_dir with its ``<run_id>-latest`` pointer or step folders, found as SpecForge's
``resolve_training_state`` finds it, then built with its ``materialize_draft``), or a draft config ``.json`` for an
untrained drafter
(SpecForge's init, seeded). The draft config defaults to ``draft_config.json`` beside the checkpoint, where
``python -m hsx_peers.specforge train`` writes it. The block size and mask token are the checkpoint's
(``dflash_block_size``, ``dflash_mask_token_id``: what it was trained with).

The checkpoint is data, never code: ``training_state.pt`` is read with ``torch.load(weights_only=True)`` and no
allowlist (what ``specforge train`` saves is tensors, dicts, lists, tuples, numbers, strings and None); a file
whose pickle names anything else (a class, a function: code that would run as the user on load, which SpecForge's
own ``weights_only=False`` loader runs) is refused in one line naming it. The draft config is JSON; the
``training_state_rank*.pt`` files (optimizer, RNG) are not read.

The request (JSON) holds ``prompts`` (lists of token ids), ``max_new_tokens``, ``stop_token_ids`` and
optionally ``teacher_forced`` = {"store", "endpoint_url", "run", "samples": [i, ...], "anchors"}.

Decoding is SpecForge's: ``DFlashDraftModel.spec_generate`` (the drafter proposes a block, the target
verifies it in one forward, the longest agreeing prefix plus the target's own next token is kept). Target-only
greedy is transformers' ``generate(do_sample=False)`` on the same prompts in the same process. A forward hook
on the target counts its forwards and reads each verification's accepted length from the block it was given
and the logits it returned (spec_generate keeps that list to itself); tau is the mean of those lengths
(bonus token included), as spec_generate counts them.

Teacher-forced (no generation): for sampled positions ``a`` of a stored sample whose next token is supervised,
the drafter gets the stored states of positions ``< a`` as context and the block ``[ids[a], mask, ...]``, as
spec_generate gives it after the target chose ``ids[a]``; its proposal is compared with ``ids[a+1:a+block]``
and the agreeing prefix counted. Progress goes to stderr as ``progress DONE TOTAL`` lines.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch


def _progress(done: int, total: int) -> None:
    print(f"progress {done} {total}", file=sys.stderr, flush=True)


def _draft_config_for(drafter: Path, given: str | None) -> Path:
    if given:
        return Path(given)
    for folder in (drafter, drafter.parent, drafter.parent.parent):
        if (folder / "draft_config.json").is_file():
            return folder / "draft_config.json"
    raise SystemExit(f"error: no draft_config.json beside {drafter}: pass --draft-config")


STATE_FILE = "training_state.pt"


def training_state_file(drafter: str) -> Path:
    """The ``training_state.pt`` SpecForge 0.2.0's ``resolve_training_state`` would read for ``drafter``, found the
    same way: the file itself, the folder's, the one ``<run_id>-latest`` pointer's, else the highest step folder's."""
    path = Path(drafter[len("file://"):] if drafter.startswith("file://") else drafter)
    if path.is_file():
        return path
    if (path / STATE_FILE).is_file():
        return path / STATE_FILE
    latest = [p for p in sorted(path.glob("*-latest")) if (p.resolve() / STATE_FILE).is_file()]
    if len(latest) > 1:
        raise SystemExit(f"error: {drafter} holds several runs ({[p.name for p in latest]}): pass the "
                         "<run_id>-step<N> folder")
    if latest:
        return latest[0].resolve() / STATE_FILE
    steps = [(int(m.group(1)), p) for p in path.glob("*-step*")
             if (m := re.search(r"-step(\d+)$", p.name)) and (p / STATE_FILE).is_file()]
    if steps:
        return max(steps)[1] / STATE_FILE
    raise SystemExit(f"error: {drafter}: no {STATE_FILE} (want the file, a <run_id>-step<N> folder, or an output_dir "
                     "with a <run_id>-latest pointer or step folders)")


def load_training_state(file: str | Path) -> dict:
    """A SpecForge training state, tensors and plain values only (``weights_only=True``, no allowlist)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        named = re.search(r"GLOBAL (\S+) was not an allowed global", str(exc))
        what = f"its pickle names {named.group(1)}" if named else "its pickle holds more"
        raise SystemExit(f"error: {file}: refused: a drafter checkpoint may hold only tensors and plain values, and "
                         f"{what} (code that would run on load); hsx reads it with torch.load(weights_only=True) "
                         "(docs/training.md)") from None
    except Exception as exc:   # not a torch file at all, truncated, ...
        raise SystemExit(f"error: {file}: cannot be read as a torch checkpoint ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})") from None
    if not isinstance(state, dict) or not isinstance(state.get("draft_state_dict"), dict):
        raise SystemExit(f"error: {file}: not a SpecForge training state (no draft_state_dict)")
    return state


def load_drafter(drafter: str, draft_config: str | None, tokenizer, vocab_size: int, dtype, device, seed: int,
                 state: dict | None = None):
    """(model, info): the DFlash draft with its trained block size and mask token. ``state``: the checkpoint's
    training state when already loaded (``load_training_state``), else it is loaded here."""
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.training.model_utils import resolve_mask_token_id

    path = Path(drafter)
    if path.suffix == ".json":   # an untrained drafter: the config alone
        torch.manual_seed(seed)
        model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(path)), torch_dtype=torch.float32)
        state, config_path = {}, path
    else:
        from specforge.export.checkpoint_io import materialize_draft

        if state is None:   # never SpecForge's own loader: it unpickles anything
            state = load_training_state(training_state_file(drafter))
        strategy = state.get("strategy")
        if strategy != "dflash":
            raise SystemExit(f"error: {drafter} is a {strategy!r} checkpoint; SpecForge 0.2.0 decodes with an HF "
                             "target for DFlash only (DFlashDraftModel.spec_generate)")
        config_path = _draft_config_for(path, draft_config)
        model = materialize_draft(state, str(config_path))
    if not hasattr(model, "spec_generate"):
        raise SystemExit(f"error: {type(model).__name__} has no spec_generate in SpecForge 0.2.0; only DFlash drafts "
                         "decode with an HF target there")
    model.block_size = int(state.get("dflash_block_size", model.block_size))
    model.mask_token_id = int(state["dflash_mask_token_id"]) if "dflash_mask_token_id" in state else \
        resolve_mask_token_id(explicit=None, tokenizer=tokenizer, embedding_vocab_size=vocab_size, draft_model=model)
    model.to(device=device, dtype=dtype).eval()
    info = {"checkpoint": str(path), "draft_config": str(config_path), "trained": bool(state),
            "global_step": state.get("global_step"), "block_size": model.block_size,
            "mask_token_id": model.mask_token_id, "target_layer_ids": [int(x) for x in model.target_layer_ids]}
    return model, info


class VerifyCounter:
    """Forward hook on the target: counts forwards, and for each verification (a forward given a block of the
    drafter's length) the accepted length, bonus token included, as spec_generate computes it at temperature 0."""

    def __init__(self, block_size: int):
        self.block_size, self.forwards, self.accepted = block_size, 0, []

    def __call__(self, module, args, kwargs, output):
        self.forwards += 1
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == self.block_size and output.logits.shape[1] == self.block_size:
            posterior = output.logits.argmax(dim=-1)
            self.accepted.append(int((ids[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum(dim=1)[0]) + 1)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode(target, draft, prompts, max_new_tokens: int, stop_token_ids: list[int], device, progress_base: int,
           total: int) -> dict:
    if draft.mask_token_id in stop_token_ids:
        raise SystemExit(f"error: the drafter's mask token {draft.mask_token_id} is a stop token; spec_generate "
                         "would stop at once")
    counter = VerifyCounter(draft.block_size)
    per_prompt, accepted = [], []
    target_seconds = spec_seconds = 0.0
    target_tokens = spec_tokens = spec_forwards = 0
    for i, prompt in enumerate([prompts[0]] + prompts):   # the first prompt once more, untimed: warm-up
        ids = torch.tensor([prompt], device=device)
        _sync(device)
        t0 = time.perf_counter()
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=stop_token_ids, pad_token_id=stop_token_ids[0])
        _sync(device)
        t1 = time.perf_counter()
        counter.forwards, counter.accepted = 0, []
        handle = target.register_forward_hook(counter, with_kwargs=True)
        try:
            spec = draft.spec_generate(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                       temperature=0.0)
        finally:
            handle.remove()
        _sync(device)
        t2 = time.perf_counter()
        if i == 0:
            continue
        plain_new, spec_new = plain[0, len(prompt):].tolist(), spec[0, len(prompt):].tolist()
        target_seconds += t1 - t0
        spec_seconds += t2 - t1
        target_tokens += len(plain_new)
        spec_tokens += len(spec_new)
        spec_forwards += counter.forwards
        accepted += counter.accepted
        per_prompt.append({"prompt_tokens": len(prompt), "generated": len(spec_new), "target_forwards": counter.forwards,
                           "tau": statistics.fmean(counter.accepted) if counter.accepted else None,
                           "identical": plain_new == spec_new,
                           "first_difference": next((k for k, (a, b) in enumerate(zip(plain_new, spec_new, strict=False)) if a != b),
                                                    None if len(plain_new) == len(spec_new)
                                                    else min(len(plain_new), len(spec_new))),
                           "tokens": spec_new, "target_only_tokens": plain_new})
        _progress(progress_base + i, total)
    hist = Counter(accepted)
    return {
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "tau": statistics.fmean(accepted) if accepted else None,
        "tau_distribution": {str(k): hist[k] for k in sorted(hist)},   # accepted length (bonus included) -> steps
        "verify_steps": len(accepted),
        "generated_tokens": spec_tokens,
        "target_forwards_per_token": spec_forwards / spec_tokens if spec_tokens else None,
        "identical_prompts": sum(p["identical"] for p in per_prompt),
        "speculative_seconds": spec_seconds, "target_only_seconds": target_seconds,
        "speculative_tokens_per_second": spec_tokens / spec_seconds if spec_seconds else None,
        "target_only_tokens_per_second": target_tokens / target_seconds if target_seconds else None,
        "speedup": (spec_tokens / spec_seconds) / (target_tokens / target_seconds)
        if spec_seconds and target_seconds and target_tokens else None,
        "seconds_per_prompt": (spec_seconds + target_seconds) / len(prompts),
        "per_prompt": per_prompt,
    }


@torch.inference_mode()
def teacher_forced(target, draft, spec: dict, dtype, device, progress_base: int, total: int) -> dict:
    from hsx.store import StoreSettings
    from hsx_reader import RunDataset

    ds = RunDataset(StoreSettings(url=spec["store"], endpoint_url=spec.get("endpoint_url")), spec["run"],
                    fetch="range")
    layer_ids = list(ds.index.layer_ids)
    if layer_ids != list(draft.target_layer_ids):
        raise SystemExit(f"error: run {spec['run']!r} stored layers {layer_ids}, the drafter reads "
                         f"{list(draft.target_layer_ids)}")
    bs, embed = draft.block_size, target.model.embed_tokens
    per_block, started = [], time.perf_counter()
    for k, index in enumerate(spec["samples"]):
        sample = ds[index]
        ids = sample["input_ids"].to(torch.int64).to(device)
        mask = sample["loss_mask"].to(torch.int64)
        hidden = sample["hidden_states"].to(device=device, dtype=dtype)
        T = len(ids)
        candidates = [a for a in range(1, T - 1) if mask[a + 1]]
        step = max(1, len(candidates) // spec["anchors"])
        for a in candidates[::step][:spec["anchors"]]:
            block = torch.full((1, bs), draft.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = ids[a]
            out = draft(target_hidden=hidden[None, :a], noise_embedding=embed(block),
                        position_ids=torch.arange(a + bs, device=device)[None], is_causal=False)
            proposal = draft._sample_draft_tokens(target, out, block)[0]
            truth = ids[a + 1:a + bs]
            n = min(len(truth), bs - 1)
            agree = (proposal[:n] == truth[:n]).to(torch.int64).cumprod(0).sum()
            per_block.append(int(agree))
        _progress(progress_base + k + 1, total)
    hist = Counter(per_block)
    return {"run": spec["run"], "samples": len(spec["samples"]), "blocks": len(per_block),
            "accepted_prefix_mean": statistics.fmean(per_block) if per_block else None,
            "tau_equivalent": statistics.fmean(per_block) + 1 if per_block else None,
            "accepted_prefix_distribution": {str(k): hist[k] for k in sorted(hist)},
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hsx_peers.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--draft-config")
    ap.add_argument("--request", required=True, help="JSON file: prompts, max_new_tokens, stop_token_ids, ...")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    request = json.loads(Path(args.request).read_text())
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    # the checkpoint first: a refused one costs no target load
    state = None if Path(args.drafter).suffix == ".json" else load_training_state(training_state_file(args.drafter))
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    draft, info = load_drafter(args.drafter, args.draft_config, tokenizer, target.config.vocab_size, dtype,
                               args.device, args.seed, state)
    prompts, tf = request.get("prompts") or [], request.get("teacher_forced")
    total = len(prompts) + (len(tf["samples"]) if tf else 0)
    report = {"drafter": info, "target": args.target, "device": args.device, "dtype": args.dtype}
    if prompts:
        report["decode"] = decode(target, draft, prompts, int(request["max_new_tokens"]),
                                  [int(x) for x in request["stop_token_ids"]], args.device, 0, total)
    if tf:
        report["teacher_forced"] = teacher_forced(target, draft, tf, dtype, args.device, len(prompts), total)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
