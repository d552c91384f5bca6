"""Shared prefixes computed once (issue 40, item 7): tok/s with and without reuse, and reused-vs-lone fidelity.

    python bench/prefix_reuse.py --cpu                                  # tiny dense + tiny hybrid on the CPU
    python bench/prefix_reuse.py --shape hybrid27b --compute-dtype float8 --out DIR   # the GPU table
    bash bench/run_gpu.sh prefix                                       # the same, fla on the path

No Redis, no store: the producer's planners (``cut_batches`` without reuse, ``cut_prefix_batches`` with) cut
the same token ids into batches under one token budget, and the worker's extractor runs them (``run`` /
``run_shared``, gpu_worker/prefixrun.py), on random weights of the shape (weights do not change the compute).

Two mixes, token ids after the tiny model's chat template (hsx_tools/data/chatml_thinking_tools.jinja, which
drops earlier turns' reasoning before the last user message, as Qwen's do; ids < 512 fit any vocabulary):
- ``agentic-per-turn``: generated agentic rows (hsx_tools/samples.py) expanded one sample per assistant turn,
  the case the issue's >= 2x goal is about. ``--per-turn hsx`` (the default): as `hsx produce --per-turn`
  makes them (a turn is what the template renders as one: a user message's tool-call steps and answer
  together); ``--per-turn every-message``: cut after every assistant message (hsx_tools/prefixshare.py
  ``expand_per_turn``, the cut behind the issue's "64.3 % skippable": tool-call steps are strict prefixes of
  each other there, so it shares far more than the samples hsx makes);
- ``seeds-like``: whole rows, agentic and plain conversations (the shipped mix's shape, about 6 % skippable):
  the >= +5 % goal.

Per mix and mode: stored tok/s (the samples' tokens over the wall time of every batch) and computed tok/s
(the tokens its forwards fed: padding in where a forward pads, each shared prefix once; the plan's own count,
plain batches at their padded size, is ``computed_tokens``), a few batches run untimed first (fla compiles
per shape), the modes timed alternately ``--repeats`` times and the fastest kept.
Fidelity: up to ``--fidelity-samples`` samples of prefix groups, each stored by ``run_shared`` and computed
alone by ``run`` on the same extractor: max relative L2 error per stored layer and max |difference|.
The plan prices a forward at ``--forward-tokens`` and lets a batch of trees store ``--stored-budgets`` token
budgets (the producer's --prefix-forward-tokens and --prefix-stored-budgets defaults): the on mode's forwards
and time say what a forward costs beside its tokens on the target measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shapes  # noqa: E402
import torch  # noqa: E402

from hsx.defaults import DEFAULT_PREFIX_FORWARD_TOKENS, DEFAULT_PREFIX_STORED_BUDGETS, PREFIX_ROWS  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx.prep import cut_batches, cut_prefix_batches  # noqa: E402

WARM_BATCHES = 3   # batches of each mode run untimed before each timed pass


def _tokenised(rows: list[dict], tokenizer_dir: Path, work: Path, per_turn: str, max_length: int) -> list:
    """Token ids of ``rows``; ``per_turn``: "" (whole rows), "hsx" or "every-message" (see the module's text)."""
    from hsx_tools.prefixshare import expand_per_turn, tokenise_file

    whole = work / "rows.jsonl"
    whole.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if per_turn == "every-message":
        expanded = work / "per_turn.jsonl"
        expand_per_turn([whole], expanded)
        whole = expanded
    return [s for s in tokenise_file(whole, str(tokenizer_dir), max_length, per_turn=per_turn == "hsx") if len(s)]


def mixes(tokens: int, work: Path, max_length: int, per_turn_how: str = "hsx", seeds_like: bool = True) -> dict[str, list]:
    """Token ids of each mix, about ``tokens`` tokens each; ``per_turn_how``: one cut or several, comma-separated
    (one agentic mix each: ``agentic-per-turn`` for hsx's, ``agentic-every-message``), then seeds-like (unless
    ``seeds_like`` is False)."""
    from hsx_tools.demo import sample_dataset
    from hsx_tools.samples import agentic_rows
    from hsx_tools.tinymodel import build_tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        build_tokenizer(tok_dir, sample_path=sample_dataset())
    plain = [json.loads(x) for x in sample_dataset().read_text().splitlines()]
    out = {}
    cuts = per_turn_how.split(",")
    named = [("agentic-per-turn" if cut == "hsx" else f"agentic-{cut}", cut) for cut in cuts]
    for name, cut in (*named, *([("seeds-like", "")] if seeds_like else [])):
        rows, seqs, n = [], [], 16
        while True:
            agentic = agentic_rows(n, seed=11)
            rows = agentic if cut else agentic + plain[: max(1, 4 * n // 3)]
            seqs = _tokenised(rows, tok_dir, work, cut, max_length)
            if sum(map(len, seqs)) >= tokens or n >= 20_000:
                break
            n = int(n * max(1.5, 1.1 * tokens / max(1, sum(map(len, seqs)))))
        out[name] = seqs
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(ex, seqs: list, planned, pad_id: int, token_budget: int, forward_tokens: int,
             warm: int = WARM_BATCHES) -> tuple[float, int, int]:
    """Seconds to run every batch of ``planned`` (a first pass over the shapes untimed), the forwards run and the
    tokens they ran (``Extractor.tokens_fed``: padding in, each packed piece once; the plan's count is padded).
    Tree batches run with the plan's budget, cached tokens (two budgets) and price of a forward; plain batches
    as the worker lays them out (``Extractor.batch``: one packed row where the forward packs, else padded)."""
    def one(batch) -> None:
        rows = [torch.as_tensor(seqs[i], dtype=torch.int64) for i in batch.members]
        ids = torch.cat(rows)
        cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist()])
        if batch.groups:
            ex.run_shared(ids, cu, [list(g) for g in batch.groups], token_budget, 2 * token_budget, forward_tokens)
        else:
            ex.run(ex.batch(ids, cu, batch.padded_len, pad_id, pin=ex.device.type == "cuda"))

    for i, batch in enumerate(planned[:warm or len(planned)]):   # untimed (fla compiles per shape)
        t = time.perf_counter()
        one(batch)
        _sync(ex.device)   # each warm batch's seconds in the log: a compile shows as a batch far slower than the rest
        print(f"  warm batch {i}: {len(batch.members)} rows, {len(batch.groups or ())} groups, {time.perf_counter() - t:.1f} s", flush=True)
    forwards = [0]

    def counting(real):
        def counted(*args, **kwargs):
            forwards[0] += 1
            return real(*args, **kwargs)
        return counted

    ex.forward_packed, ex.forward_rows = counting(ex.forward_packed), counting(ex.forward_rows)
    try:
        t, fed = time.perf_counter(), ex.tokens_fed
        for batch in planned:
            one(batch)
        _sync(ex.device)
        return time.perf_counter() - t, forwards[0], ex.tokens_fed - fed
    finally:
        del ex.forward_packed, ex.forward_rows


def fidelity(ex, seqs: list, planned, limit: int, budget: int, forward_tokens: int) -> dict:
    """Samples of prefix groups stored by ``run_shared`` against each computed alone by ``run``, beside the same
    samples computed by ``run`` in one plain padded batch with their group (no reuse) against alone: the noise
    floor of the device's arithmetic. On a GPU a sample's rows differ with the shapes it is computed in (GEMM
    tilings, and with FP8 compute every rounding re-drawn by the next quantiser), so reuse is judged against that
    floor, not against zero. Lone rows are padded to their batch's width (one shape a batch: fla compiles per
    shape; padding after a row does not change it)."""
    from gpu_worker.extractor import pad_batch

    n = len(ex.layer_ids)
    worst = {"reused": [0.0] * n, "batched": [0.0] * n}
    worst_abs, checked = {"reused": 0.0, "batched": 0.0}, 0
    H = ex.hidden_size

    def diff(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.float(), want.float()
        worst_abs[name] = max(worst_abs[name], float((got - want).abs().max()))
        for k in range(n):
            g, w = got[:, k * H:(k + 1) * H], want[:, k * H:(k + 1) * H]
            worst[name][k] = max(worst[name][k], float((g - w).norm() / w.norm().clamp_min(1e-30)))

    for batch in (b for b in planned if b.groups and limit > 0):
        rows = [torch.as_tensor(seqs[i], dtype=torch.int64) for i in batch.members]
        cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist()])
        ids = torch.cat(rows)
        hidden, _ = ex.run_shared(ids, cu, [list(g) for g in batch.groups], budget, 2 * budget, forward_tokens)
        take = min(limit - checked, len(rows), max(1, budget // batch.padded_len))   # the plain batch in budget
        plain, _ = ex.run(pad_batch(ids[:int(cu[take])], cu[:take + 1], batch.padded_len, 0, pin=False))
        for b in range(take):
            alone, _ = ex.run(pad_batch(rows[b], torch.tensor([0, len(rows[b])]), batch.padded_len, 0, pin=False))
            diff("reused", hidden[int(cu[b]):int(cu[b + 1])], alone)
            diff("batched", plain[int(cu[b]):int(cu[b + 1])], alone)
            checked += 1
        if checked >= limit:
            break
    return {"samples": checked, "max_rel_l2_per_layer": worst["reused"], "max_abs": worst_abs["reused"],
            "batched_max_rel_l2_per_layer": worst["batched"], "batched_max_abs": worst_abs["batched"]}


def tree_batch_waits(ex, seqs: list, planned, args) -> list[str]:
    """Where the first tree batch of ``planned`` makes the host wait for the GPU (bench/forward_host.py
    ``host_waits``), run once before to compile."""
    from forward_host import host_waits

    batch = next((b for b in planned if b.groups), None)
    if batch is None:
        return []
    rows = [torch.as_tensor(seqs[i], dtype=torch.int64) for i in batch.members]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(r) for r in rows]), 0).tolist()])
    ids = torch.cat(rows)

    def one() -> None:
        ex.run_shared(ids, cu, [list(g) for g in batch.groups], args.token_budget, 2 * args.token_budget,
                      args.forward_tokens)

    one()
    _sync(ex.device)
    try:
        waits = host_waits(one)
    except Exception as exc:   # a diagnostic: the timing after it must still run
        waits = [f"not measured: {type(exc).__name__}: {exc}"]
    _sync(ex.device)
    return waits


def fidelity_line(mix: str, fid: dict, seconds: float) -> str:
    def layers(key: str) -> str:
        return " ".join(f"{e:.1e}" for e in fid[key])

    return (f"[bench] {mix} ({fid['samples']} samples, {seconds:.0f}s), rel L2 per stored layer against alone: "
            f"reused {layers('max_rel_l2_per_layer')} (max |d| {fid['max_abs']:.1e}); in a plain batch, no reuse "
            f"{layers('batched_max_rel_l2_per_layer')} (max |d| {fid['batched_max_abs']:.1e})")


def bench_shape(args, shape: str, seqs_by_mix: dict) -> dict:
    cpu = args.cpu
    device = torch.device("cpu" if cpu else "cuda:0")
    dtype, out_dtype = (torch.float32, "float32") if cpu or args.model_dtype == "float32" else (torch.bfloat16, "bfloat16")
    config = shapes.make_config(shape, vocab_size=512 if shape.startswith("tiny") else None)
    t0 = time.perf_counter()
    model = shapes.build_model(config, device, dtype)
    from gpu_worker.extractor import Extractor
    from hsx.runspec import text_config

    layer_ids, store_final = resolve_layers(args.layers, text_config(config).num_hidden_layers)
    if cpu and args.reference_kernels:   # the fused glue and packed rows on the CPU: forwards counted, not timed
        from gpu_worker import kernels

        reference = kernels.reference_for(model)
        kernels.choose = lambda mode, dev: (reference, "") if mode != "eager" else (None, "--kernels eager")
    ex = Extractor(model, layer_ids, store_final, out_dtype=out_dtype, kernels=args.kernels)
    result = {"shape": shape, "device": "cpu" if cpu else torch.cuda.get_device_name(0),
              "compute_dtype": args.compute_dtype, "forward": ex.kernels_line, "token_budget": args.token_budget,
              "mixes": []}
    print(f"[bench] {shape} built in {time.perf_counter() - t0:.1f}s; forward: {ex.kernels_line}", flush=True)
    for compute in args.compute_dtype.split(","):   # bf16 first, then the same weights converted to FP8
        if compute == "float8":
            ex.fp8_pending = True
            ex.convert_to_fp8()
        print(f"[bench] compute {compute}", flush=True)
        result["mixes"] += [dict(row, compute_dtype=compute) for row in bench_mixes(args, ex, seqs_by_mix, shape)]
    return result


def planned_at(args, seqs: list, price: int, stored_budgets: int = 1, rows: str = ""):
    """The mix's batches with shared prefixes computed once, planned at ``price`` a forward, ``stored_budgets``
    token budgets a batch of trees may store and ``rows`` (packed | padded; default ``--prefix-rows``): the
    producer's planner, as `hsx produce` calls it."""
    return cut_prefix_batches(seqs, args.token_budget, args.max_batch_rows, args.pad_multiple, args.min_prefix,
                              2 * args.token_budget, price, stored_budgets * args.token_budget,
                              packed=(rows or args.prefix_rows) == "packed")


def bench_mixes(args, ex, seqs_by_mix: dict, shape: str) -> list[dict]:
    rows = []
    for mix, seqs in seqs_by_mix.items():
        lengths = [len(s) for s in seqs]
        stored = sum(lengths)
        off = cut_batches(lengths, args.token_budget, args.max_batch_rows, args.pad_multiple)
        on = planned_at(args, seqs, args.forward_tokens, args.stored_budgets)
        modes = [("off", off), ("on", on)]
        if args.also_forward_tokens is not None:   # the same mix planned at a second price, timed alongside
            modes.append(("on_at", planned_at(args, seqs, args.also_price)))
        if args.also_stored_budgets:   # and at that price (or the default), batches of trees storing more budgets
            modes.append(("on_wide", planned_at(args, seqs, args.also_price, args.also_stored_budgets)))
        if args.also_padded_rows:   # the on mode's plan with a group's rows padded (the plan before --prefix-rows)
            modes.append(("on_padded", planned_at(args, seqs, args.forward_tokens, args.stored_budgets, "padded")))
        row = {"mix": mix, "rows": len(seqs), "stored_tokens": stored}
        t0 = time.perf_counter()   # exactness first: a pass cut at its limit still has it
        row["fidelity"] = fid = fidelity(ex, seqs, on, args.fidelity_samples, args.token_budget, args.forward_tokens)
        print(fidelity_line(mix, fid, time.perf_counter() - t0), flush=True)
        if args.fidelity_only:
            rows.append(row)
            continue
        if ex.device.type == "cuda":   # where a tree batch makes the host wait for the GPU (it then cannot queue
            row["host_waits"] = waits = tree_batch_waits(ex, seqs, on, args)   # the next forward meanwhile)
            print(f"[bench] {mix}: one tree batch waits for the GPU {len(waits)} times"
                  + "".join(f"\n    {n} x {where}" for where, n in Counter(waits).most_common(8)), flush=True)
        seconds, forwards, ran = {mode: [] for mode, _ in modes}, {}, {}
        for _ in range(args.repeats):   # alternately, the fastest of each kept: a shared machine's noise out
            for mode, planned in modes:
                t0 = time.perf_counter()
                took, forwards[mode], ran[mode] = run_mode(ex, seqs, planned, 0, args.token_budget,
                                                           args.forward_tokens, args.warm_batches)
                seconds[mode].append(took)
                print(f"[bench] {mix} {mode}: {len(planned)} batches, {forwards[mode]} forwards, timed {took:.1f}s "
                      f"(warm-up included: {time.perf_counter() - t0:.1f}s)", flush=True)
        for mode, planned in modes:
            computed = sum(b.computed for b in planned)
            seconds_ = min(seconds[mode])
            row[mode] = {"batches": len(planned), "forwards": forwards[mode], "computed_tokens": computed,
                         "tokens_run": ran[mode],
                         "seconds": seconds_,
                         "stored_tok_s": stored / seconds_, "computed_tok_s": ran[mode] / seconds_}
        row["speedup"] = row["on"]["stored_tok_s"] / row["off"]["stored_tok_s"]
        rows.append(row)
        print(line(shape, row), flush=True)
        for mode, at in ((m, row[m]) for m in ("on_at", "on_wide", "on_padded") if m in row):
            at["forward_tokens"] = args.forward_tokens if mode == "on_padded" else args.also_price
            at["stored_budgets"] = {"on_wide": args.also_stored_budgets, "on_padded": args.stored_budgets}.get(mode, 1)
            at["rows"] = "padded" if mode == "on_padded" else args.prefix_rows
            print(f"{shape:10s} {mix:17s} planned at --prefix-forward-tokens {at['forward_tokens']}, "
                  f"--prefix-stored-budgets {at['stored_budgets']}, --prefix-rows {at['rows']}: {at['batches']} batches, "
                  f"{at['computed_tokens']:,} computed in {at['forwards']} forwards ({at['tokens_run']:,} run), "
                  f"{at['stored_tok_s']:,.0f} stored "
                  f"tok/s | x{at['stored_tok_s'] / row['off']['stored_tok_s']:.2f} off", flush=True)
    return rows


def line(shape: str, row: dict) -> str:
    off, on, fid = row["off"], row["on"], row["fidelity"]
    return (f"{shape:10s} {row['mix']:17s} {row['stored_tokens']:>9,} stored | off: {off['computed_tokens']:>9,} "
            f"computed, {off['stored_tok_s']:>9,.0f} stored tok/s | on: {on['computed_tokens']:>9,} computed "
            f"in {on['forwards']} forwards ({on['tokens_run']:,} run; off ran {off['tokens_run']:,}), "
            f"{on['stored_tok_s']:>9,.0f} stored tok/s, {on['computed_tok_s']:>9,.0f} tok/s run | "
            f"x{row['speedup']:.2f} | reused vs lone: rel L2 <= {max(fid['max_rel_l2_per_layer'] or [0]):.1e}, "
            f"max |d| {fid['max_abs']:.1e} ({fid['samples']} samples)")


def computes(value: str) -> str:
    if value not in ("bfloat16", "float8", "bfloat16,float8"):
        raise argparse.ArgumentTypeError(f"--compute-dtype {value!r}: bfloat16, float8 or bfloat16,float8")
    return value


def per_turn_cuts(value: str) -> str:
    cuts = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in cuts if c not in ("hsx", "every-message")]
    if not cuts or bad or len(set(cuts)) != len(cuts):
        raise argparse.ArgumentTypeError(f"--per-turn {value!r}: hsx, every-message, or both comma-separated")
    return ",".join(cuts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny dense + tiny hybrid on the CPU (float32)")
    ap.add_argument("--shape", default="hybrid27b", choices=shapes.SHAPES)
    ap.add_argument("--tokens", type=int, default=0, help="tokens a mix (default: 30k on the CPU, 300k on a GPU)")
    ap.add_argument("--token-budget", type=int, default=0, help="default: 8192 on the CPU, 32768 on a GPU")
    ap.add_argument("--max-length", type=int, default=0, help="default: the token budget")
    ap.add_argument("--max-batch-rows", type=int, default=512)
    ap.add_argument("--pad-multiple", type=int, default=8)
    ap.add_argument("--min-prefix", type=int, default=32)
    ap.add_argument("--forward-tokens", type=int, default=DEFAULT_PREFIX_FORWARD_TOKENS,
                    help="the plan's price of a forward in tokens (hsx produce --prefix-forward-tokens)")
    ap.add_argument("--layers", default="", help="default: dflash (dflash:3 on the CPU's tiny shapes)")
    ap.add_argument("--compute-dtype", default="bfloat16", type=computes,
                    help="bfloat16, float8, or bfloat16,float8 (the same weights measured in bf16, then in FP8)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "padded", "eager"))
    ap.add_argument("--reference-kernels", action="store_true",
                    help="with --cpu: the fused kernels' torch reference installed, so packed rows run here (the "
                         "forwards a mode takes, counted; not a speed)")
    ap.add_argument("--fidelity-samples", type=int, default=16)
    ap.add_argument("--fidelity-only", action="store_true", help="reused and batched vs lone only, no timing")
    ap.add_argument("--model-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the GPU model's dtype (float32: reused vs lone without bf16 rounding; the CPU is float32)")
    ap.add_argument("--warm-batches", type=int, default=WARM_BATCHES,
                    help="batches of each mode run untimed before its timed pass (0: all of them: every shape "
                         "compiled off the clock)")
    ap.add_argument("--no-seeds-like", action="store_true", help="the agentic mix(es) only")
    ap.add_argument("--seeds-like-first", action="store_true",
                    help="measure the seeds-like mix before the agentic one(s) (a call cut at its limit keeps it)")
    ap.add_argument("--also-forward-tokens", type=int, default=None,
                    help="a third mode: the mixes planned at this price of a forward too, timed alongside")
    ap.add_argument("--stored-budgets", type=int, default=DEFAULT_PREFIX_STORED_BUDGETS,
                    help="token budgets a batch of trees may store in the timed mode (hsx produce's default)")
    ap.add_argument("--also-stored-budgets", type=int, default=0,
                    help="a mode more: the mixes planned with batches of trees storing this many token budgets "
                         "(hsx produce --prefix-stored-budgets), at --also-forward-tokens' price if given")
    ap.add_argument("--prefix-rows", default=PREFIX_ROWS[0], choices=PREFIX_ROWS,
                    help="how the on mode's plan counts a tree batch's rows (hsx produce --prefix-rows)")
    ap.add_argument("--also-padded-rows", action="store_true",
                    help="a mode more: the on mode's plan with --prefix-rows padded (the plan before it), timed alongside")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes of each mode, alternating; the fastest kept")
    ap.add_argument("--per-turn", default="hsx", type=per_turn_cuts,
                    help="how the agentic mix is cut into one sample a turn (see the module's text): hsx, "
                         "every-message, or both comma-separated (an agentic mix each)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.tokens = args.tokens or (30_000 if args.cpu else 300_000)
    args.token_budget = args.token_budget or (8192 if args.cpu else 32768)
    args.max_length = args.max_length or args.token_budget
    args.also_price = args.forward_tokens if args.also_forward_tokens is None else args.also_forward_tokens
    args.layers = args.layers or ("dflash:3" if args.cpu else "dflash")
    with tempfile.TemporaryDirectory(prefix="hsx-prefix-bench-") as tmp:
        t = time.perf_counter()
        seqs = mixes(args.tokens, Path(tmp), args.max_length, args.per_turn, not args.no_seeds_like)
        if args.seeds_like_first:
            seqs = dict(sorted(seqs.items(), key=lambda item: item[0] != "seeds-like"))
        print(f"[bench] mixes tokenised in {time.perf_counter() - t:.1f}s: "
              + ", ".join(f"{k} {len(v):,} rows {sum(map(len, v)):,} tokens" for k, v in seqs.items()), flush=True)
        results = [bench_shape(args, shape, seqs) for shape in (("tiny", "tiny-hybrid") if args.cpu else (args.shape,))]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = ("prefix_reuse-cpu" if args.cpu else f"prefix_reuse-{args.shape}-{args.compute_dtype.replace(',', '-')}") + (
            "" if args.per_turn == "hsx" else "-" + args.per_turn.replace(",", "-")) + ".json"
        (out / name).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
