"""`hsx show RUN [SAMPLE]`: what a run stored, read back through hsx_reader (each object checked against the
size and SHA-256 the run's index recorded).

Without SAMPLE: the run (model, layers, dtype, samples, objects, bytes) and its first sample ids. With SAMPLE (a
sample id, or ``#N`` for line N of the index, 0-based): the sample's text with the loss-masked tokens marked
(bold green on a terminal, ``[[...]]`` when piped), every tensor's shape and dtype, per stored layer the hidden
states' mean, std, max |x| and non-finite count, and the bytes of the sample and of its batch object. The text
needs the run's tokenizer (its manifest's model); where that cannot be loaded the ids are shown instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from hsx.errors import ConfigError
from hsx.monitor import fmt_bytes
from hsx.printable import printable
from hsx.store import StoreSettings

SAMPLE_IDS_LISTED = 10


@dataclass(frozen=True)
class ShowConfig:
    run: str
    sample: str | None               # a sample id, or "#N": line N of the index
    store: StoreSettings | None      # None: the store the run recorded in Redis
    redis_url: str | None
    chars: int                       # characters of the text shown (plain output)
    plain: bool                      # [[...]] markers even on a terminal


def layer_stats(hidden: torch.Tensor, layer_ids: list, hidden_size: int) -> list[dict]:
    """Per stored layer (the slices of ``hidden`` [T, n*H], low to high): mean, std, max |x|, non-finite count."""
    out = []
    for i, layer in enumerate(layer_ids):
        x = hidden[:, i * hidden_size:(i + 1) * hidden_size].float()
        finite = torch.isfinite(x)
        good = x[finite]
        out.append({"layer": layer, "mean": good.mean().item() if good.numel() else float("nan"),
                    "std": good.std().item() if good.numel() > 1 else 0.0,
                    "max_abs": good.abs().max().item() if good.numel() else float("nan"),
                    "non_finite": int((~finite).sum())})
    return out


def stats_lines(stats: list[dict]) -> list[str]:
    lines = [f"  {'layer':>8} {'mean':>11} {'std':>11} {'max |x|':>11} {'non-finite':>10}"]
    for s in stats:
        lines.append(f"  {s['layer']:>8} {s['mean']:>11.4g} {s['std']:>11.4g} {s['max_abs']:>11.4g} {s['non_finite']:>10}")
    return lines


def _tokenizer(model: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model), None
    except Exception as exc:  # the run's model may not be reachable here; the numbers still are
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _find(ds, run: str, sample: str):
    index = ds.index
    ref = index.by_id.get(sample)
    if ref is None and sample.startswith("#") and sample[1:].isdigit():
        position = int(sample[1:])
        if position >= len(index.samples):
            raise ConfigError(f"run {run!r} has {len(index.samples)} samples: no line {position} (#0..#"
                              f"{len(index.samples) - 1})")
        ref = index.samples[position]
    if ref is None:
        some = ", ".join(s.sample_id for s in index.samples[:5])
        raise ConfigError(f"sample {sample!r} is not in run {run!r} (ids such as {printable(some)}; or #N for line N of "
                          "the index)")
    return ref


def show_run(ds, run: str) -> None:
    index, manifest = ds.index, ds.manifest
    sizes = [index.digests.get(k, (0, ""))[0] for k in index.keys()]
    print(f"run {run}: {len(index.samples)} samples in {len(sizes)} batch objects, {fmt_bytes(sum(sizes))}; model "
          f"{printable(manifest.model)}, layers {manifest.layer_ids}{' + final' if manifest.store_final else ''} x "
          f"{manifest.hidden_size}, {manifest.store_dtype or manifest.dtype}"
          + (f" + {manifest.codec}" if getattr(manifest, "codec", "none") not in (None, "none") else ""))
    for ref in index.samples[:SAMPLE_IDS_LISTED]:
        print(f"  #{ref.position}  {printable(ref.sample_id)}  ({printable(ref.key)}, row {ref.row})")
    if len(index.samples) > SAMPLE_IDS_LISTED:
        print(f"  ... {len(index.samples) - SAMPLE_IDS_LISTED} more")
    print(f"show one: hsx show {run} SAMPLE_ID   (or #N, line N of the index)")


def show_sample(ds, run: str, sample: str, chars: int, plain: bool) -> None:
    from hsx_tools.samplerender import render_sample, sample_segments

    ref = _find(ds, run, sample)
    data = ds.get(ref.sample_id)          # fetch="object": the whole object, checked against its digest
    manifest, index = ds.manifest, ds.index
    ids, mask, hidden = data["input_ids"], data["loss_mask"], data["hidden_states"]
    size = index.digests.get(ref.key, (None, None))[0]
    checked = "size + SHA-256 checked against the index" if ref.key in index.digests else "no digest in the index"
    print(f"sample {printable(ref.sample_id)} of run {run}: #{ref.position}, row {ref.row} of {printable(ref.key)} "
          f"({fmt_bytes(size) if size else '?'}; {checked})")
    tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    for name, t in tensors.items():
        print(f"  {name:<20} {str(list(t.shape)):<14} {str(t.dtype).replace('torch.', ''):<10} {fmt_bytes(t.nbytes)}")
    print(f"  {len(ids)} tokens, {int(mask.sum())} in the loss mask; {fmt_bytes(sum(t.nbytes for t in tensors.values()))} "
          "for this sample")
    print(f"hidden states, per stored layer ({manifest.store_dtype or manifest.dtype} stored, read as {hidden.dtype}):")
    print("\n".join(stats_lines(layer_stats(hidden, list(manifest.layer_ids), manifest.hidden_size))))
    if "final_hidden_states" in data:
        print("\n".join(stats_lines(layer_stats(data["final_hidden_states"], ["final"], manifest.hidden_size))[1:]))
    tokenizer, why = _tokenizer(manifest.model)
    tty = sys.stdout.isatty() and not plain
    if tokenizer is None:
        print(f"text: the run's tokenizer ({printable(manifest.model)}) cannot be loaded here ({printable(why)}); ids: "
              f"{ids[:64].tolist()}{' ...' if len(ids) > 64 else ''}")
        return
    print("text (in the loss mask: " + ("bold green)" if tty else "[[...]])"))
    segments = sample_segments(tokenizer, ids.numpy() if hasattr(ids, "numpy") else ids, mask)
    if tty:
        from rich.console import Console

        render_sample(segments, Console(highlight=False))
        return
    text = render_sample(segments)
    print(text if len(text) <= chars else text[:chars] + f" ... [{len(text)} chars]")


def run_show(cfg: ShowConfig) -> int:
    from hsx_reader import RunDataset
    from hsx_tools.export import run_store

    settings = run_store(cfg)       # --store, else the store the run recorded in Redis
    ds = RunDataset(settings, cfg.run, fetch="object", verify=True)
    if cfg.sample is None:
        show_run(ds, cfg.run)
    else:
        show_sample(ds, cfg.run, cfg.sample, cfg.chars, cfg.plain)
    return 0
