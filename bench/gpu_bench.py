"""GPU throughput benchmark: the full pipeline against a bare forward of the same model, same run.

One command on a GPU machine (no internet; see bench/run_gpu.sh, which installs
the offline wheels and runs every shape):

    bash bench/run_gpu.sh                      # all shapes, table last, JSON under $OUT
    python bench/gpu_bench.py --shape qwen3-8b --sections mix32k,uniform1024 --out DIR
    python bench/gpu_bench.py --cpu            # tiny model on the CPU: orchestration ms per batch
    python bench/gpu_bench.py --padding        # target 3: padding of 1M planned samples, no GPU
    python bench/gpu_bench.py --table DIR      # the table of every JSON in DIR

Per section: plan with the real producer (pre-tokenised rows), run the same
padded batches through (a) the model's full body and (b) the layers the
pipeline keeps (dflash stops after layer 33 of 36), with no capture and no
I/O, then (c) the pipeline: rq worker in this process (hooks, packing, side
stream copy to pinned memory, writer thread, spool files), ``hsx upload``
processes into a local-directory store, Redis ledger. See harness.py for how
tokens/s and GPU busy are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import shapes  # noqa: E402
import torch  # noqa: E402

from hsx.defaults import DEFAULT_FP8_ACCUMULATION, FP8_ACCUMULATIONS  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx.prep.planning import cut_batches, padding_fraction  # noqa: E402

# section: (length mix, token budget, also time the full body, worker knobs[, store dtype, codec])
# Knobs: "serial" = the writer before issue 6 (one writer thread, sha256 then write on that thread).
# Issue 15's sections (mix32k_bf16, _fp8, _zstd, _fp8zstd) use the memory tier when --memory-spool-gib > 0.
SECTIONS = {
    "mix32k_bf16": ("mix", 32768, True, None, "bfloat16", "none"),
    "mix32k_fp8": ("mix", 32768, True, None, "float8_e4m3", "none"),
    "mix32k_zstd": ("mix", 32768, True, None, "bfloat16", "zstd"),
    "mix32k_fp8zstd": ("mix", 32768, True, None, "float8_e4m3", "zstd"),
    "cpu-formats": ("mix", 4096, True, None, "float8_e4m3", "zstd"),
    "mix32k": ("mix", 32768, True, None),
    "mix32k_serial": ("mix", 32768, True, "serial"),
    "uniform1024": ("uniform1024", 32768, True, None),
    "mix64k": ("mix", 65536, False, None),
    "mix16k": ("mix", 16384, False, None),
    "cpu-mix": ("mix", 4096, True, None),
    "cpu-mix_serial": ("mix", 4096, True, "serial"),
}


def set_knobs(knobs: str | None) -> None:
    from gpu_worker import writer
    from hsx.batch import batchfile

    writer.WRITER_THREADS = 1 if knobs == "serial" else 2
    batchfile.HASH_IN_PARALLEL = knobs != "serial"



def run_shape(args) -> dict:
    cpu = args.cpu
    device = torch.device("cpu" if cpu else "cuda:0")
    dtype, out_dtype = (torch.float32, "float32") if cpu else (torch.bfloat16, "bfloat16")
    config = shapes.make_config(args.shape, vocab_size=512 if args.shape.startswith("tiny") else None)
    t = time.perf_counter()
    model = shapes.build_model(config, device, dtype)
    if args.compute_dtype == "float8":  # as the worker does (gpu_worker/extractor.py): the decoder's linears
        from gpu_worker import fp8compute, fp8linear
        from gpu_worker.extractor import _decoder

        fp8compute.require_fp8_device(device)
        converted = fp8linear.convert_linears(_decoder(model).layers, fast_accum=args.fp8_accumulation == "fast")
        print(f"[bench] float8 compute: {converted} linear layers as rowwise e4m3 GEMMs", flush=True)
        torch.cuda.empty_cache()
    build_s = time.perf_counter() - t
    result = {"shape": args.shape, "tag": args.tag, "compute_dtype": args.compute_dtype,
              "fp8_accumulation": args.fp8_accumulation,
              "device": torch.cuda.get_device_name(0) if not cpu else "cpu",
              "torch": torch.__version__, "fla": shapes.fla_available(), "body_params": shapes.body_params(model),
              "build_s": build_s, "sections": []}
    import transformers

    result["transformers"] = transformers.__version__
    print(f"[bench] {args.shape} ({args.tag}): {result['body_params'] / 1e9:.2f}B body params on {result['device']}, "
          f"built in {build_s:.1f}s, fla={'yes' if result['fla'] else 'no'}", flush=True)
    work = Path(args.workdir) / f"{args.shape}-{args.tag}"
    if args.memory_spool_gib == "auto":  # the worker's default (hsx_cli/worker.py)
        from hsx.runspec import spool

        budget, why = spool.auto_memory_budget(Path(args.memory_spool_dir))
        args.memory_spool_gib = budget / harness.GiB
        print(f"[bench] memory tier {args.memory_spool_gib:.1f} GiB ({why})", flush=True)
    args.memory_spool_gib = float(args.memory_spool_gib)
    result["memory_spool_gib"] = args.memory_spool_gib
    svc, redis_server, uploaders = harness.start_services(work, config, device, args.uploaders, args.store_dir,
                                                          args.memory_spool_dir if args.memory_spool_gib else None)
    try:
        if args.io_probe:
            result["io"] = harness.io_probe(svc.spool_dir)
            print(f"[bench] io: {result['io']}", flush=True)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(svc.model_path))
        harness.wait_uploaders(svc, uploaders)
        num_layers = config.num_hidden_layers
        layer_ids, store_final = resolve_layers(args.layers, num_layers)
        from gpu_worker.extractor import _decoder

        decoder = _decoder(model)
        full_layers = decoder.layers
        extractor = harness.timed_extractor(model, layer_ids, store_final, out_dtype, svc.clock, args.kernels)
        result["kernels"], result["forward"] = args.kernels, extractor.kernels_line
        print(f"[bench] forward: {extractor.kernels_line}", flush=True)
        kept_layers = decoder.layers
        bare_cache: dict = {}
        for name in args.sections.split(","):
            kind, budget, with_full, knobs, *fmt = SECTIONS[name]
            store_dtype, codec = fmt or (None, "none")
            budget = args.token_budget or budget
            with_full = with_full and not args.no_full
            run = f"{name}-{args.tag}"[:64]
            lengths = harness.lengths_for(kind, args.tokens, seed=1)
            dataset = harness.write_dataset(work / f"{name}.jsonl", lengths, vocab)
            t = time.perf_counter()
            report, specs = harness.plan(svc, run, dataset, budget, out_dtype, layers=args.layers,
                                         store_dtype=store_dtype, codec=codec,
                                         compute_dtype=args.compute_dtype,
                                         fp8_accumulation=args.fp8_accumulation if args.compute_dtype == "float8"
                                         else DEFAULT_FP8_ACCUMULATION)  # produce refuses fast with bf16 compute
            print(f"[bench] {name}: {len(lengths)} samples, {report.batches} batches, "
                  f"padding {1 - report.tokens / report.padded_tokens:.2%}, planned in {time.perf_counter() - t:.1f}s", flush=True)
            batch_shapes = [(s.samples, s.padded_len, s.tokens) for s in specs]
            section = {"section": name, "knobs": knobs or "default", "kind": kind, "token_budget": budget, "samples": len(lengths),
                       "batches": len(specs), "tokens": report.tokens, "plan_padding": 1 - report.tokens / report.padded_tokens,
                       "layer_ids": layer_ids, "num_layers": num_layers}
            cached = bare_cache.get((kind, budget))  # a variant of a section already timed reuses its bare runs
            # A packing extractor's bare pass runs the same batches packed, as its pipeline does.
            packed = (extractor, harness.plan_bounds(svc, run, specs)) if extractor.packs else None
            if cached:
                section["bare_full"], section["bare_kept"] = cached
            else:
                if with_full and len(kept_layers) != len(full_layers):
                    section["bare_full"] = harness.bare_forward(decoder, full_layers, batch_shapes, vocab, device,
                                                                svc.clock, args.warm, packed)
                    print(f"[bench]   bare {len(full_layers)} layers: {section['bare_full']['tok_s']:.0f} tok/s", flush=True)
                section["bare_kept"] = harness.bare_forward(decoder, kept_layers, batch_shapes, vocab, device,
                                                            svc.clock, args.warm, packed)
                bare_cache[(kind, budget)] = (section.get("bare_full"), section["bare_kept"])
            section.setdefault("bare_full", section["bare_kept"] if len(kept_layers) == len(full_layers) else None)
            print(f"[bench]   bare {len(kept_layers)} layers: {section['bare_kept']['tok_s']:.0f} tok/s", flush=True)
            result["sections"].append(section)
            write_json(args, result)   # a step cut in its pipeline pass keeps its bare figures
            if not uploaders.alive():
                raise RuntimeError(f"an uploader exited; see {work / 'logs'}")
            set_knobs(knobs)
            try:
                pipe = harness.run_pipeline(svc, run, extractor, specs, args.warm, int(args.spool_budget_gib * harness.GiB),
                                            memory_budget_bytes=int(args.memory_spool_gib * harness.GiB))
            except Exception as exc:  # keep the bare numbers and go on with the next section
                section["error"] = f"{type(exc).__name__}: {exc}"
                print(f"[bench]   pipeline FAILED: {section['error']}", flush=True)
                write_json(args, result)
                continue
            finally:
                set_knobs(None)
            section["pipeline"] = pipe
            section["ratio_kept"] = pipe["tok_s"] / section["bare_kept"]["tok_s"]
            if section["bare_full"]:
                section["ratio_full"] = pipe["tok_s"] / section["bare_full"]["tok_s"]
            print(f"[bench]   pipeline: {pipe['tok_s']:.0f} tok/s (x{section['ratio_kept']:.3f} of bare kept), "
                  f"busy {pipe['busy']:.1%}, e2e {pipe['e2e_tok_s']:.0f} tok/s, spool peak {pipe['spool_peak_gib']:.2f} GiB, "
                  f"overhead {pipe['overhead_ms_per_batch']:.1f} ms/batch, batches run {pipe['batches_run']} of "
                  f"{pipe['all_batches']} planned" + (" (more than planned: a batch failed and ran again)"
                                                    if pipe['batches_run'] > pipe['all_batches'] else "")
                  + (f", compute-error pass {pipe['compute_error_pass_s']:.2f} s (once a run, in the warm-up)"
                     if pipe["compute_error_pass_s"] else ""), flush=True)
            print(f"[bench]   {pipe['store_dtype']}/{pipe['codec']}: {pipe['bytes_per_token']:.0f} bytes/token, ratio "
                  f"{pipe['codec_ratio']:.3f}, codec {pipe['codec_wall_s_per_gb']:.2f} writer-s/GB, process CPU "
                  f"{pipe['process_cpu_s_per_gb_raw']:.2f} s/GB, tiers {pipe['tier_bytes']}, write GiB/s "
                  f"{pipe['tier_write_gib_s']}, emit {pipe['emit_gib_s']:.2f} GiB/s, tail {pipe['tail_share']:.1%}",
                  flush=True)
            write_json(args, result)
    finally:
        uploaders.stop()
        redis_server.stop()
    return result


def write_json(args, result: dict) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result['shape']}-{result['tag']}.json").write_text(json.dumps(result, indent=1, default=str))


def padding_table(args) -> dict:
    """Target 3: padded share of computed tokens for 1M lognormal samples, per token budget and pad multiple."""
    lengths = harness.lengths_lognormal(args.padding_samples, seed=0).tolist()
    rows = []
    for budget in (16384, 32768, 65536, 131072):
        for multiple in (1, 8, 64):
            t = time.perf_counter()
            batches = cut_batches(lengths, budget, 512, multiple)
            rows.append({"token_budget": budget, "pad_multiple": multiple, "batches": len(batches),
                         "padding": padding_fraction(batches), "plan_s": time.perf_counter() - t})
            print(f"[padding] budget {budget:>6} pad_multiple {multiple:>2}: {len(batches)} batches, "
                  f"padding {rows[-1]['padding']:.3%}", flush=True)
    result = {"shape": "padding", "tag": f"{len(lengths)}", "samples": len(lengths),
              "mean_len": sum(lengths) / len(lengths), "rows": rows}
    write_json(args, result)
    return result


def print_table(out_dir: Path) -> None:
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]
    results = [r for r in results if isinstance(r, dict)]   # another bench's JSON (prefix_reuse writes a list)
    head = (f"{'configuration':<40} {'useful tok/s':>12} {'x bare':>7} {'x full':>7} {'busy %':>7} "
            f"{'pad %':>6} {'peak GiB':>9} {'spool GiB':>9} {'e2e tok/s':>10}")
    print(head)
    print("-" * len(head))
    for res in results:
        if res.get("shape") == "padding":
            continue
        for s in res.get("sections", []):
            name = f"{res['shape']}/{res['tag']} {s['section']}"
            fmt = lambda v, f: (f.format(v) if v is not None else "-")  # noqa: E731
            if s.get("bare_full") and s["bare_full"]["layers"] != s["bare_kept"]["layers"]:
                b = s["bare_full"]
                print(f"{name + ' bare ' + str(b['layers']) + 'L':<40} {b['tok_s']:>12.0f} {'':>7} {'1.000':>7} "
                      f"{100 * b['busy']:>7.1f} {100 * b['padding']:>6.2f} {fmt(b['peak_gib'], '{:>9.1f}')}")
            b = s["bare_kept"]
            print(f"{name + ' bare ' + str(b['layers']) + 'L':<40} {b['tok_s']:>12.0f} {'1.000':>7} "
                  f"{fmt(b['tok_s'] / s['bare_full']['tok_s'] if s.get('bare_full') else None, '{:>7.3f}')} "
                  f"{100 * b['busy']:>7.1f} {100 * b['padding']:>6.2f} {fmt(b['peak_gib'], '{:>9.1f}')}")
            if "pipeline" not in s:
                print(f"{name + ' pipeline':<40} failed: "
                      + s.get("error", "the pass did not finish (the step's time ran out)"))
                continue
            p = s["pipeline"]
            print(f"{name + ' pipeline':<40} {p['tok_s']:>12.0f} {s['ratio_kept']:>7.3f} "
                  f"{fmt(s.get('ratio_full'), '{:>7.3f}')} {100 * p['busy']:>7.1f} {100 * p['padding']:>6.2f} "
                  f"{fmt(p['peak_gib'], '{:>9.1f}')} {p['spool_peak_gib']:>9.2f} {p['e2e_tok_s']:>10.0f}")
    for res in results:
        if res.get("shape") == "padding":
            best = {r["token_budget"]: r["padding"] for r in res["rows"] if r["pad_multiple"] == 8}
            print(f"padding, {res['samples']} lognormal samples, pad_multiple 8: "
                  + ", ".join(f"{b // 1024}k {100 * v:.2f}%" for b, v in best.items()))
        elif res.get("io"):
            print(f"{res['shape']}/{res['tag']} host I/O: write+fsync {res['io']['write_fsync_gib_s']:.2f} GiB/s, "
                  f"sha256 {res['io']['sha256_gib_s']:.2f} GiB/s")
    for res in results:
        for s in res.get("sections", []):
            p = s.get("pipeline")
            if not p or "bytes_per_token" not in p:
                continue
            print(f"{res['shape']}/{res['tag']} {s['section']}: {p['store_dtype']}/{p['codec']} "
                  f"{p['bytes_per_token']:.0f} bytes/token (ratio {p['codec_ratio']:.3f}), codec "
                  f"{p['codec_wall_s_per_gb']:.2f} writer-s/GB raw, process CPU {p['process_cpu_s_per_gb_raw']:.2f} s/GB raw, "
                  f"e2e {p['e2e_tok_s']:.0f} tok/s (tail {100 * p['tail_share']:.1f}%), tiers "
                  + ", ".join(f"{k} {v / 2**30:.1f} GiB @ {p['tier_write_gib_s'].get(k, 0):.2f} GiB/s"
                              for k, v in p["tier_bytes"].items()) + f", emit {p['emit_gib_s']:.2f} GiB/s")
    for res in results:
        for s in res.get("sections", []):
            if "pipeline" not in s:
                continue
            p = s["pipeline"]
            print(f"{res['shape']}/{res['tag']} {s['section']}: host RSS peak {p['rss_peak_gib']:.1f} GiB "
                  f"(2nd-half growth {p['rss_second_half_growth_gib']:+.2f}), pinned {p['pinned_gib']:.1f} GiB, "
                  f"overhead {p['overhead_ms_per_batch']:.1f} ms/batch, nvml util "
                  f"{p['nvml_util_mean'] if p['nvml_util_mean'] is None else round(p['nvml_util_mean'], 1)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny model on the CPU (orchestration overhead in ms a batch)")
    ap.add_argument("--shape", default=None, choices=shapes.SHAPES)
    ap.add_argument("--tag", default=None, help="label of this process's results (e.g. fla / torch)")
    ap.add_argument("--sections", default=None, help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--tokens", type=int, default=None, help="real tokens a section plans")
    ap.add_argument("--token-budget", type=int, default=None, help="override the sections' token budget")
    ap.add_argument("--layers", default=None, help="layer spec (default dflash; dflash:3 on tiny shapes)")
    ap.add_argument("--no-full", action="store_true", help="skip the bare forward through the full body")
    ap.add_argument("--kernels", default="auto", choices=("auto", "padded", "eager"),
                    help="the forward's kernels, as `hsx worker --kernels` (gpu_worker/kernels.py)")
    ap.add_argument("--compute-dtype", default="bfloat16", choices=("bfloat16", "float8"),
                    help="the linear layers as rowwise e4m3 GEMMs (float8), as `hsx produce --compute-dtype`")
    ap.add_argument("--fp8-accumulation", default=DEFAULT_FP8_ACCUMULATION, choices=FP8_ACCUMULATIONS,
                    help="how float8's GEMMs accumulate, as `hsx produce --fp8-accumulation`")
    ap.add_argument("--warm", type=int, default=2, help="batches left out of the timed window")
    ap.add_argument("--uploaders", type=int, default=4)
    ap.add_argument("--spool-budget-gib", type=float, default=24.0, help="the disk tier's budget")
    ap.add_argument("--memory-spool-gib", default="auto", help="the memory tier's budget in GiB (0: none; auto: "
                    "as `hsx worker` sizes it by default, from the tmpfs's free space)")
    ap.add_argument("--memory-spool-dir", default="/dev/shm/hsx-bench-mem", help="the memory tier (a tmpfs)")
    ap.add_argument("--io-probe", action="store_true", help="measure write+fsync and sha256 speed first")
    ap.add_argument("--store-dir", default=None, help="local-directory store (default under --workdir; "
                    "/dev/shm: bytes off the disk, as with S3)")
    ap.add_argument("--workdir", default=os.environ.get("HSX_BENCH_WORKDIR", "/tmp/hsx-bench"))
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    ap.add_argument("--padding", action="store_true", help="target 3 only (no GPU)")
    ap.add_argument("--padding-samples", type=int, default=1_000_000)
    ap.add_argument("--table", default=None, help="print the table of the JSON files in this folder and exit")
    args = ap.parse_args(argv)
    if args.table:
        print_table(Path(args.table))
        return 0
    if args.padding:
        padding_table(args)
        return 0
    if args.cpu:
        args.shape = args.shape or "tiny"
        args.sections = args.sections or "cpu-mix,cpu-mix_serial"
        args.tokens = args.tokens or 60_000
        args.uploaders = min(args.uploaders, 2)
    if not args.shape:
        ap.error("--shape, --cpu, --padding or --table")
    args.tag = args.tag or ("cpu" if args.cpu else "gpu")
    args.layers = args.layers or ("dflash:3" if args.shape.startswith("tiny") else "dflash")
    args.sections = args.sections or "mix32k"
    args.tokens = args.tokens or 500_000
    run_shape(args)
    if args.cpu:
        print_table(Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
