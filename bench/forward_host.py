"""What a forward costs beside its tokens: the host's time to queue it against the GPU's time to run it (issue 40).

    python bench/forward_host.py --shape hybrid27b --compute-dtype float8 [--kernels auto] [--out DIR]
    python bench/forward_host.py --cpu                      # tiny-hybrid on the CPU: the accounting, not the figures

Shared-prefix reuse runs many small forwards: a spine piece, then a group's leaves from its cached states. On
an H100 (call F) each extra forward cost ~0.150 s beside its tokens, so a tree plan that computed 4.1x fewer
tokens ran 2.1x slower. This measures where that time goes, through the worker's own extractor
(gpu_worker/extractor.py ``forward_packed``), for the forward shapes a tree batch runs:

- ``plain``: rows x T tokens, no cache (a spine piece from token 0, or a whole batch);
- ``cached``: rows x T tokens continuing a past of P tokens (a group's leaves: one row's cache, copied and
  expanded to the rows as gpu_worker/prefixrun.py does; the copy and the expansion timed on their own).

Per shape, after a warm call (fla compiles per shape): ``queue`` = seconds for the call to return with the GPU not
waited for (the host's own work, unless the launch queue fills), ``wall`` = until the GPU is done, ``kernels`` =
the GPU's kernel time and launch count (torch.profiler). A forward whose queue time is near its wall is host-bound:
its GPU idles between kernels. ``syncs``: where a call makes the host wait for the GPU (torch's sync debug mode).
Then the host work of one cached forward by function (cProfile: own time, grouped by where the code lives), so
the cure is aimed, not guessed.

The table is printed last; JSON in DIR/forward_host_<shape>.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shapes  # noqa: E402
import torch  # noqa: E402

from gpu_worker import prefixrun  # noqa: E402
from gpu_worker.extractor import Extractor  # noqa: E402
from hsx.layers import resolve_layers  # noqa: E402
from hsx.runspec import text_config  # noqa: E402

# (name, rows, tokens a row, past tokens): what a tree batch of the every-message mix runs (bench/prefix_waves.py)
GPU_SHAPES = (("plain", 1, 32768, 0), ("plain", 1, 2048, 0), ("plain", 1, 256, 0),
              ("cached", 8, 256, 2048), ("cached", 32, 64, 1024), ("cached", 1, 256, 4096))
CPU_SHAPES = (("plain", 1, 256, 0), ("plain", 1, 32, 0), ("cached", 4, 16, 128))
WHERE = (("transformers", "/transformers/"), ("fla / triton", ("/fla/", "/triton/")), ("hsx", "/gpu_worker/"),
         ("torch.nn and python", ("/torch/", "/python3", "/kernels/")), ("torch ops (C++ dispatch, launches)", "~"))


def where(filename: str) -> str:
    for name, keys in WHERE:
        if any(k in filename for k in ((keys,) if isinstance(keys, str) else keys)):
            return name
    return "other"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Case:
    """One forward shape: its inputs, and (cached) the one-row cache of its past, copied and expanded per call."""

    def __init__(self, ex: Extractor, kind: str, rows: int, tokens: int, past: int, vocab: int):
        self.ex, self.kind, self.rows, self.tokens, self.past = ex, kind, rows, tokens, past
        gen = torch.Generator().manual_seed(rows * 7919 + tokens + past)
        self.ids = torch.randint(0, vocab, (rows, tokens), generator=gen).to(ex.device)
        self.flat = torch.arange(rows * tokens, device=ex.device)
        self.base = None
        if kind == "cached":
            self.base = prefixrun._cache_for(ex.model)
            spine = torch.randint(0, vocab, (1, past), generator=gen).to(ex.device)
            with torch.inference_mode():
                ex.forward_packed(spine, torch.arange(past, device=ex.device), past, cache=self.base, start=0)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.rows} x {self.tokens}" + (f" after {self.past}" if self.past else "")

    def fresh_cache(self):
        """The one-row cache expanded to the rows, as the worker does it (the held cache unchanged)."""
        if self.base is None:
            return None
        return prefixrun._merged_cache(self.ex, [self.base], [self.rows], [self.past])

    def forward(self, cache) -> None:
        self.ex.forward_packed(self.ids, self.flat, self.flat.numel(), cache=cache, start=self.past)


@torch.inference_mode()
def measure(case: Case, repeats: int) -> dict:
    device = case.ex.device
    case.forward(case.fresh_cache())   # warm: fla compiles and autotunes per shape
    queue, wall, prep = [], [], []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        cache = case.fresh_cache()
        sync(device)
        prep.append(time.perf_counter() - t)
        t = time.perf_counter()
        case.forward(cache)
        queue.append(time.perf_counter() - t)
        sync(device)
        wall.append(time.perf_counter() - t)
    kernel_ms, launches = kernel_time(case)
    best = min(range(repeats), key=lambda i: wall[i])
    return {"shape": case.label, "rows": case.rows, "tokens": case.tokens, "past": case.past, "syncs": syncs(case),
            "queue_s": queue[best], "wall_s": wall[best], "kernel_s": kernel_ms / 1e3, "launches": launches,
            "cache_copy_s": min(prep) if case.base is not None else 0.0,
            "tok_s": case.rows * case.tokens / wall[best]}


def kernel_time(case: Case) -> tuple[float, int]:
    """GPU kernel time (ms) and launches of one call; on the CPU, the aten ops' own time and count."""
    from torch.profiler import ProfilerActivity, profile

    cuda = case.ex.device.type == "cuda"
    cache = case.fresh_cache()
    sync(case.ex.device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        case.forward(cache)
        sync(case.ex.device)
    ms, count = 0.0, 0
    for event in prof.key_averages():
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if own > 0 and (cuda or event.key.startswith("aten::")):
            ms += own / 1e3
            count += event.count
    return ms, count


@torch.inference_mode()
def syncs(case: Case) -> list[str]:
    """Where one call makes the host wait for the GPU: a sync mid-forward serialises the host's work with the
    GPU's."""
    if case.ex.device.type != "cuda":
        return []
    cache = case.fresh_cache()
    sync(case.ex.device)
    found = host_waits(lambda: case.forward(cache))
    sync(case.ex.device)
    return found


def host_waits(call) -> list[str]:
    """Run ``call()`` under torch's sync debug mode (a warning at each op that makes the host wait for the GPU)
    and return where each wait came from: the two innermost frames outside torch and the warnings module."""
    import traceback
    import warnings

    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
        found.append(" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-2:]))
                     or str(message)[:80])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return found


@torch.inference_mode()
def host_profile(case: Case, top: int) -> dict:
    """cProfile of one call's host work: own seconds by where the code lives, and the top functions."""
    cache = case.fresh_cache()
    sync(case.ex.device)
    prof = cProfile.Profile()
    prof.enable()
    case.forward(cache)
    prof.disable()
    sync(case.ex.device)
    stats = pstats.Stats(prof).stats
    by_where: dict[str, float] = defaultdict(float)
    rows = []
    for (filename, line, func), (_cc, calls, own, _cum, _callers) in stats.items():
        by_where[where(filename)] += own
        rows.append((own, calls, f"{Path(filename).name}:{line}({func})" if line else func))
    rows.sort(reverse=True)
    return {"shape": case.label, "total_s": sum(by_where.values()),
            "by_where": dict(sorted(by_where.items(), key=lambda kv: -kv[1])),
            "top": [{"own_s": own, "calls": calls, "function": name} for own, calls, name in rows[:top]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="hybrid27b", choices=shapes.SHAPES)
    ap.add_argument("--compute-dtype", default="float8", choices=("bfloat16", "float8"))
    ap.add_argument("--kernels", default="auto", choices=("auto", "padded", "eager"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="tiny-hybrid on the CPU (float32)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    shape = "tiny-hybrid" if args.cpu else args.shape
    device = torch.device("cpu" if args.cpu else "cuda:0")
    config = shapes.make_config(shape, vocab_size=512 if shape.startswith("tiny") else None)
    t0 = time.perf_counter()
    model = shapes.build_model(config, device, torch.float32 if args.cpu else torch.bfloat16)
    layer_ids, store_final = resolve_layers("dflash" if not args.cpu else "dflash:3", text_config(config).num_hidden_layers)
    ex = Extractor(model, layer_ids, store_final, out_dtype="float32" if args.cpu else "bfloat16", kernels=args.kernels)
    if args.cpu:
        args.compute_dtype = "float32"
    if args.compute_dtype == "float8":
        ex.fp8_pending = True
        ex.convert_to_fp8()
    print(f"[host] {shape} built in {time.perf_counter() - t0:.1f}s; compute {args.compute_dtype}; "
          f"forward: {ex.kernels_line}", flush=True)
    rows, vocab = [], text_config(config).vocab_size
    cases = [Case(ex, *spec, vocab=vocab) for spec in (CPU_SHAPES if args.cpu else GPU_SHAPES)]
    for case in cases:
        row = measure(case, args.repeats)
        rows.append(row)
        print(f"[host] {json.dumps(row)}", flush=True)
    for row in rows:
        print(f"[host] {row['shape']}: {len(row['syncs'])} host waits for the GPU"
              + (f" at {', '.join(sorted(set(row['syncs'])))}" if row["syncs"] else ""), flush=True)
    profiled = host_profile(next(c for c in cases if c.kind == "cached"), top=25)
    print(f"\nhost work of one {profiled['shape']} forward (cProfile, own time; it slows the host about 2x):")
    for name, seconds in profiled["by_where"].items():
        print(f"  {name:<40} {seconds * 1e3:8.1f} ms")
    for row in profiled["top"]:
        print(f"  {row['own_s'] * 1e3:8.2f} ms {row['calls']:6d} calls  {row['function'][:90]}")
    result = {"shape": shape, "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
              "compute_dtype": args.compute_dtype, "forward": ex.kernels_line, "rows": rows, "host_profile": profiled}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"forward_host_{shape}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{result['device']}, {shape}, {args.compute_dtype}, {ex.kernels_line}")
    print(f"{'forward':<28} {'queue ms':>9} {'wall ms':>9} {'kernels ms':>10} {'launches':>9} {'cache copy ms':>13} "
          f"{'tok/s':>9}")
    for r in rows:
        print(f"{r['shape']:<28} {r['queue_s'] * 1e3:9.1f} {r['wall_s'] * 1e3:9.1f} {r['kernel_s'] * 1e3:10.1f} "
              f"{r['launches']:9d} {r['cache_copy_s'] * 1e3:13.1f} {r['tok_s']:9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
