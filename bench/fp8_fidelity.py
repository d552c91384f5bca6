"""FP8 *compute* fidelity on trained weights (GPU with FP8 tensor cores), next to the FP8 *storage* error.

    python bench/fp8_fidelity.py --minutes 2 --out bench-out

Trains a small Qwen3 (H=512, 8 layers) on text on the GPU long enough to grow outlier channels, saves it,
then extracts the dflash layers of held-out text three ways through the worker's own loader
(``Extractor.load``): bf16 compute (the reference), ``compute_dtype=float8`` from the bf16 checkpoint, and
``compute_dtype=float8`` from an e4m3 block-scaled (128x128 ``weight_scale_inv``) copy of the checkpoint, as
the published FP8 releases are stored. Per layer: relative L2 and mean cosine of each against the bf16
reference, beside the FP8 storage error (one scale a token a layer) of the bf16 states and max|x|/rms.
The FP8 GEMMs accumulate as ``--fp8-accumulation`` says (default fp32, as `hsx produce`); the other
accumulation is a column of its own (what choosing it costs, on the same weights and text).

Second table (issue 39), against an **fp32** forward of the same trained model (transformers' eager code in
fp32): bf16 and FP8 compute, each through transformers' forward (``--kernels eager``) and the fused kernels
(``--kernels auto``, gpu_worker/kernels.py), per stored layer. ``--arch hybrid`` trains a small Qwen3.5 text
model (Gated DeltaNet layers, every 4th full attention: the 27B's layer pattern) instead of the Qwen3, so the
fused GDN path (fla's conv, in-kernel gating, gated norm) is measured on trained weights; fla must be importable
for its training and its fused rows (bench/run_gpu.sh's fidelity step puts it on the path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.activation_stats import texts  # noqa: E402
from gpu_worker.extractor import Extractor, pack_batch, pad_batch  # noqa: E402
from gpu_worker.fp8compute import write_fp8_checkpoint  # noqa: E402
from hsx.batch.dtypes import fp8_error, quantise_fp8  # noqa: E402
from hsx.defaults import DEFAULT_FP8_ACCUMULATION, FP8_ACCUMULATIONS  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx_tools.demo import sample_dataset  # noqa: E402
from hsx_tools.tinymodel import build_tokenizer  # noqa: E402

WIDTH, ROWS = 1024, 8   # every measured batch is ROWS x WIDTH, right-padded


@dataclass
class Fixed:
    """A measured batch: ROWS samples (packed ids, bounds), of which the first ``real`` tokens are measured."""

    ids: torch.Tensor
    cu: torch.Tensor
    real: int

    def run(self, ex: Extractor) -> torch.Tensor:
        """The stored layers of the measured tokens, the batch laid out as ``ex``'s forward runs it: one packed
        row where it packs rows, else ROWS rows right-padded to WIDTH."""
        laid = pack_batch(self.ids, self.cu, pin=False) if ex.packs else pad_batch(self.ids, self.cu, WIDTH, 0, pin=False)
        return ex.run(laid)[0][:self.real]


def fixed_batches(samples: list[list[int]]) -> list[Fixed]:
    """The samples (each at most WIDTH tokens) in batches of one shape, ROWS right-padded rows of WIDTH (the
    last filled with copies of the first sample, not measured twice: only a batch's first ``real`` tokens are
    kept). fla's Triton kernels compile and autotune per new shape, so one shape is one compile per column
    where a batch a text was minutes of compiling (the device calls of 2026-12-06 never finished it)."""
    batches = []
    for at in range(0, len(samples), ROWS):
        rows = samples[at:at + ROWS]
        real = sum(len(r) for r in rows)
        rows = rows + [samples[0]] * (ROWS - len(rows))
        ids = torch.tensor([t for r in rows for t in r])
        cu = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
        batches.append(Fixed(ids, cu, real))
    return batches


def compare(ref: torch.Tensor, x: torch.Tensor, n_layers: int) -> list[tuple[float, float]]:
    H = ref.shape[1] // n_layers
    out = []
    for k in range(n_layers):
        a, b = ref[:, k * H:(k + 1) * H].float(), x[:, k * H:(k + 1) * H].float()
        rel = float((a - b).norm() / a.norm())
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=1).mean())
        out.append((rel, cos))
    return out


def extract(path: Path, layer_ids, batches, compute: str, accumulation: str = DEFAULT_FP8_ACCUMULATION) -> torch.Tensor:
    ex = Extractor.load(str(path), layer_ids, False, "cuda:0", "bfloat16", compute_dtype=compute,
                        fp8_accumulation=accumulation)
    outs = [b.run(ex).clone() for b in batches]
    del ex
    torch.cuda.empty_cache()
    return torch.cat(outs)


def kernel_fidelity(path: Path, layer_ids, batches, device: str, only: str = "") -> tuple[list[str], list[list[float]]]:
    """(column names, per stored layer the rel L2 of each column against an fp32 eager forward); ``only``: the
    columns to run, comma-separated (each column compiles fla's kernels for its dtypes first: minutes on a GPU)."""
    def run(compute: str, kernels: str, dtype: str) -> torch.Tensor:
        ex = Extractor.load(str(path), layer_ids, False, device, out_dtype=dtype, model_dtype=dtype,
                            compute_dtype=compute, kernels=kernels)
        print(f"[fidelity] {compute} --kernels {kernels}: {ex.kernels_line}", flush=True)
        outs = [b.run(ex).float().clone() for b in batches]
        del ex
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return torch.cat(outs)

    ref = run("bfloat16", "eager", "float32")   # compute_dtype bfloat16 + model dtype float32: an fp32 forward
    fp8 = device.startswith("cuda") and torch.cuda.get_device_capability(device) >= (8, 9)
    # fused: the fused kernels on padded rows; packed: the same with each batch one packed row (the default
    # where the forward packs; on the CPU no kernel packs, and the column is the eager forward again)
    columns = [("bf16 eager", "bfloat16", "eager"), ("bf16 fused", "bfloat16", "padded"),
               ("bf16 packed", "bfloat16", "auto")]
    columns += [("FP8 eager", "float8", "eager"), ("FP8 fused", "float8", "padded"),
                ("FP8 packed", "float8", "auto")] if fp8 else []
    if only:
        wanted = [c.strip() for c in only.split(",")]
        unknown = set(wanted) - {name for name, _, _ in columns}
        if unknown:
            raise SystemExit(f"--columns: unknown {sorted(unknown)}; these run here: {[n for n, _, _ in columns]}")
        columns = [c for c in columns if c[0] in wanted]
    errs = []
    for name, compute, kernels in columns:   # each printed when done: a cut pass keeps the columns it finished
        errs.append([r for r, _ in compare(ref, run(compute, kernels, "bfloat16"), len(layer_ids))])
        print(f"[fidelity] {name}: rel L2 per stored layer " + " ".join(f"{e:.2e}" for e in errs[-1]), flush=True)
    return [name for name, _, _ in columns], [list(row) for row in zip(*errs, strict=False)]


def hybrid_config(tok, hidden: int, layers: int):
    """A small Qwen3.5 text model: Gated DeltaNet layers, every 4th layer full attention (the 27B's pattern)."""
    from transformers import Qwen3_5TextConfig

    heads = max(hidden // 64, 2)
    return Qwen3_5TextConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                             head_dim=64, linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
                             linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096,
                             tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def train_target(model_dir: Path, minutes: float, hidden: int, layers: int, seq: int, batch: int,
                 device: str = "cuda", arch: str = "dense"):
    """Train a small Qwen3 on generated text (bench/activation_stats.texts) for ``minutes``, save it in bf16 to
    ``model_dir`` with its tokenizer; (tokenizer, 64 held-out texts, steps, losses every 100 steps).
    Also bench/drafter_acceptance.py's target."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    tok = build_tokenizer(model_dir, vocab_size=2048, sample_path=sample_dataset())
    cfg = hybrid_config(tok, hidden, layers) if arch == "hybrid" else Qwen3Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    corpus = texts(0, 40000)
    held_out, train = corpus[:64], corpus[64:]
    stream = torch.tensor([t for text in train for t in tok(text + "<|im_end|>").input_ids]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    model.train()
    t0, step, losses = time.time(), 0, []
    while time.time() - t0 < minutes * 60:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), device=device)
        ids = torch.stack([stream[s:s + seq] for s in starts.tolist()])
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 100 == 0:
            losses.append(float(loss.detach()))
            print(f"step {step}: loss {losses[-1]:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.to(torch.bfloat16).save_pretrained(model_dir)
    del model, opt
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tok, held_out, step, losses


def trained_target(work: Path, args):
    """``train_target``'s result, trained now or (``--trained``) read back from what ``--train-only`` saved."""
    record = work / "trained.json"
    if args.trained:
        from transformers import AutoTokenizer

        saved = json.loads(record.read_text())
        return AutoTokenizer.from_pretrained(work / "bf16"), texts(0, 40000)[:64], saved["steps"], saved["losses"]
    tok, held_out, step, losses = train_target(work / "bf16", args.minutes, args.hidden, args.layers, args.seq,
                                               args.batch, args.device, args.arch)
    record.write_text(json.dumps({"steps": step, "losses": losses}))
    return tok, held_out, step, losses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0, help="GPU training time")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fp8-accumulation", choices=FP8_ACCUMULATIONS, default=DEFAULT_FP8_ACCUMULATION,
                    help="of the FP8 compute and checkpoint columns; the other accumulation is a column of its own")
    ap.add_argument("--arch", choices=("dense", "hybrid"), default="dense",
                    help="the trained target: a Qwen3, or a Qwen3.5 text model (Gated DeltaNet + attention)")
    ap.add_argument("--kernels-only", action="store_true",
                    help="only the second table (fp32 reference; eager vs fused kernels)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the bench's code (no FP8 columns)")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--train-only", action="store_true",
                    help="train and save the target, then stop: run it where fla is not importable (fla's backward "
                         "refuses Hopper with Triton < 3.7.1; transformers picks fla at import)")
    ap.add_argument("--trained", action="store_true", help="measure the target a --train-only run saved")
    ap.add_argument("--columns", default="", help="--kernels-only: the columns to measure, comma-separated "
                    "(bf16 eager, bf16 fused, FP8 eager, FP8 fused; default all)")
    ap.add_argument("--held-out", type=int, default=64, help="held-out texts measured (64)")
    args = ap.parse_args()
    out = Path(args.out)
    work = Path("/tmp/hsx-fp8-fidelity")
    tok, held_out, step, losses = trained_target(work, args)
    if args.train_only:
        return 0
    layer_ids, _ = resolve_layers("dflash", args.layers)
    batches = fixed_batches([tok(text).input_ids[:WIDTH] for text in held_out[:args.held_out]])
    names, errs = kernel_fidelity(work / "bf16", layer_ids, batches, args.device, args.columns)
    out.mkdir(parents=True, exist_ok=True)
    kernels_result = {"config": vars(args), "steps": step, "loss_last": losses[-1] if losses else None,
                      "against": "fp32 eager", "layers": [dict(layer=layer, **dict(zip(names, row, strict=False)))
                                                          for layer, row in zip(layer_ids, errs, strict=False)]}
    (out / f"kernel_fidelity-{args.arch}.json").write_text(json.dumps(kernels_result, indent=1))
    print(f"trained {args.arch} {step} steps, loss {kernels_result['loss_last']}; rel L2 against an fp32 forward:")
    print(f"{'layer':>5} " + " ".join(f"{n:>11}" for n in names))
    for layer, row in zip(layer_ids, errs, strict=False):
        print(f"{layer:>5} " + " ".join(f"{e:>11.2e}" for e in row))
    if args.kernels_only:
        return 0
    write_fp8_checkpoint(work / "bf16", work / "fp8")
    tok.save_pretrained(work / "fp8")
    ref = extract(work / "bf16", layer_ids, batches, "bfloat16")   # default accumulation: bf16 has no other
    fp8_bf16ckpt = extract(work / "bf16", layer_ids, batches, "float8", args.fp8_accumulation)
    other = "fast" if args.fp8_accumulation == "fp32" else "fp32"   # what the other accumulation costs
    fp8_other = extract(work / "bf16", layer_ids, batches, "float8", other)
    fp8_fp8ckpt = extract(work / "fp8", layer_ids, batches, "float8", args.fp8_accumulation)
    q, scales = quantise_fp8(ref, len(layer_ids))
    store = fp8_error(ref, q, scales)
    a, b = compare(ref, fp8_bf16ckpt, len(layer_ids)), compare(ref, fp8_fp8ckpt, len(layer_ids))
    c = compare(ref, fp8_other, len(layer_ids))
    H = args.hidden
    rows = []
    for k, layer in enumerate(layer_ids):
        block = ref[:, k * H:(k + 1) * H].float()
        rows.append({"layer": layer, "compute_rel_l2": a[k][0], "compute_cosine": a[k][1],
                     f"compute_{other}_accum_rel_l2": c[k][0], f"compute_{other}_accum_cosine": c[k][1],
                     "fp8_ckpt_rel_l2": b[k][0], "fp8_ckpt_cosine": b[k][1],
                     "store_rel_l2": float(store[0, k]), "store_cosine": float(store[1, k]),
                     "max_over_rms": float(block.abs().max() / block.pow(2).mean().sqrt())})
    result = {"config": vars(args), "steps": step, "loss_last": losses[-1] if losses else None,
              "tokens": ref.shape[0], "layers": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_fidelity.json").write_text(json.dumps(result, indent=1))
    print(f"trained {step} steps, loss {result['loss_last']}; {ref.shape[0]} held-out tokens")
    print(f"{'layer':>5} {'max/rms':>8} {'FP8 compute relL2':>18} {'cos':>8} {other + ' accum':>12} {'cos':>8} "
          f"{'FP8 ckpt relL2':>15} {'cos':>8} "
          f"{'FP8 store relL2':>16} {'cos':>8}")
    for r in rows:
        print(f"{r['layer']:>5} {r['max_over_rms']:>8.0f} {r['compute_rel_l2']:>18.4f} {r['compute_cosine']:>8.5f} "
              f"{r[f'compute_{other}_accum_rel_l2']:>12.4f} {r[f'compute_{other}_accum_cosine']:>8.5f} "
              f"{r['fp8_ckpt_rel_l2']:>15.4f} {r['fp8_ckpt_cosine']:>8.5f} {r['store_rel_l2']:>16.4f} "
              f"{r['store_cosine']:>8.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
