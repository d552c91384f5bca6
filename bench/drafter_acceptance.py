"""What FP8 costs in acceptance: DFlash drafters trained from hsx runs of one target (bf16 store, FP8 store, FP8
compute, FP8 compute + FP8 store), the same steps and seed, measured by `hsx evaluate` side by side.

On the H200 (one call, aimed at 6-8 minutes: 1.5 min target training, 4 extractions of 2,000 rows, 4 x 300 drafter
steps, 5 evaluations of 16 prompts; .whl/ and .redis/ made by `EXTRA=1 bash bench/prepare_offline.sh`, which carries
specforge 0.2.0 --no-deps and its small deps):

    source bench/install_offline.sh && PYTHONPATH=$PWD:$PWD/peers:$PYTHONPATH python bench/drafter_acceptance.py \
        --device cuda:0 --out $OUT 2>&1 | tee $OUT/log

Here, on a CPU, at a tiny size (SpecForge from scripts/peers.sh's venv; FP8 compute needs FP8 tensor cores, so
its two runs are left out on a CPU):

    .venv/bin/python bench/drafter_acceptance.py --device cpu --minutes 0.1 --hidden 64 --layers 6 --seq 64 \
        --batch 8 --train-rows 64 --held-out 4 --steps 5 --block-size 4 --max-new-tokens 16 --dflash-layers 3 \
        --peer-python .peers/specforge/bin/python --out /tmp/hsx-acceptance

1. The target: bench/fp8_fidelity.py's (a small Qwen3 trained on generated text for ``--minutes`` on the device,
   saved in bf16), with the ``*.index.json`` SpecForge's target head reads.
2. ``--train-rows`` texts of its training corpus and ``--held-out`` texts it never saw, as pre-tokenised rows
   (``input_ids`` + ``loss_mask``: the first ``--prompt-tokens`` tokens unsupervised, the prompt at evaluation).
3. One hsx run per case through produce -> worker -> uploader (in this process, a private redis-server, a local
   store), dflash layers, `--layers dflash:N`.
4. ``python -m hsx_peers.specforge train`` (SpecForge's own trainer, the run read in place, ``hsx://R``) trains a
   DFlash drafter of each run: ``--steps`` steps, seed 0, the same config; ``sdpa`` attention, ``NO_SHARD``.
5. `hsx evaluate` of each drafter (and of the untrained one) against the bf16 target: held-out prompts, greedy,
   tau, target forwards per token, speedup over target-only greedy in the same process, and the teacher-forced
   accepted prefix from the held-out rows' stored states, extracted as a run of their own in the same case.

Writes ``drafter_acceptance.json`` and prints the table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_fidelity import train_target  # noqa: E402
from hsx.redisconn import LocalRedis  # noqa: E402
from hsx.runspec.config import ProduceConfig, StoreSettings, UploadConfig, WorkerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # name -> (compute dtype, store dtype)
    "bf16": ("bfloat16", None),
    "fp8-store": ("bfloat16", "float8_e4m3"),
    "fp8-compute": ("float8", None),
    "fp8-compute-store": ("float8", "float8_e4m3"),
}


def write_rows(path: Path, tok, texts: list[str], prompt_tokens: int, max_tokens: int) -> Path:
    with open(path, "w") as fh:
        for i, text in enumerate(texts):
            ids = tok(text + "<|im_end|>").input_ids[:max_tokens]
            if len(ids) <= prompt_tokens + 2:
                continue
            mask = [0] * prompt_tokens + [1] * (len(ids) - prompt_tokens)
            fh.write(json.dumps({"id": f"r{i}", "input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def index_for_specforge(model: Path) -> None:
    """SpecForge's TargetHead reads the LM head through ``*.index.json``; the target is one file."""
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def extract(redis_url: str, model: Path, store: Path, spool: Path, run: str, dataset: Path, layers: str, device: str,
            compute: str, store_dtype: str | None, token_budget: int) -> float:
    from gpu_worker.worker import run_worker
    from producer.produce import produce
    from uploader.worker import run_uploader

    started = time.monotonic()
    produce(ProduceConfig(run=run, dataset=dataset, model=str(model), layers=layers, store=StoreSettings(url=str(store)),
                          redis_url=redis_url, token_budget=token_budget, max_length=token_budget, overlong="drop",
                          max_batch_rows=64, pad_multiple=1, dtype="bfloat16", batches_per_shard=16,
                          tokenise_workers=1, store_dtype=store_dtype, compute_dtype=compute))
    run_worker(WorkerConfig(run=run, redis_url=redis_url, device=device, spool_dir=spool, spool_budget_bytes=2**40,
                            host="bench", model_override=None, burst=True, worker_name=f"gpu-bench-{run}",
                            heartbeat_seconds=1.0))
    run_uploader(UploadConfig(redis_url=redis_url, spool_dir=spool, host="bench", burst=True,
                              worker_name=f"upload-bench-{run}", heartbeat_seconds=1.0))
    return time.monotonic() - started


def peer_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    extra = [str(ROOT), str(ROOT / "peers")]
    env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    return env


def train_drafter(python: str, work: Path, model: Path, store: Path, run: str, args) -> tuple[Path, float]:
    output_dir = work / f"ckpt-{run}"
    config = {
        "model": {"target_model_path": str(model), "lm_head_key": "model.embed_tokens.weight",
                  "draft_block_size": args.block_size},
        "data": {"hidden_states_path": f"hsx://{run}", "max_length": args.seq, "dataloader_num_workers": 0,
                 "cache_dir": str(work / "cache")},
        "training": {"strategy": "dflash", "batch_size": args.train_batch, "num_epochs": 1000, "max_steps": args.steps,
                     "learning_rate": args.lr, "lr_scheduler": "constant", "attention_backend": "sdpa",
                     "fsdp_sharding": "NO_SHARD", "log_interval": max(1, args.steps // 10), "seed": 0,
                     "num_anchors": args.anchors, "save_interval": args.steps},
        "run_id": run, "output_dir": str(output_dir),
    }
    path = work / f"train-{run}.json"
    path.write_text(json.dumps(config))
    started = time.monotonic()
    proc = subprocess.run([python, "-m", "hsx_peers.specforge", "train", "-c", str(path), "--hsx-store", str(store)],
                          env=peer_env(), cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"specforge train of {run} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return output_dir, time.monotonic() - started


def evaluate(python: str, model: Path, drafter: Path, draft_config: Path, dataset: Path, store: Path | None,
             run: str | None, args) -> dict:
    argv = [sys.executable, "-m", "hsx_cli.main", "evaluate", "--model", str(model), "--drafter", str(drafter),
            "--draft-config", str(draft_config), "--dataset", str(dataset), "--limit", str(args.held_out),
            "--max-new-tokens", str(args.max_new_tokens), "--device", args.device, "--peer-python", python, "--json"]
    if run:
        argv += ["--run", run, "--store", str(store), "--held-out", str(args.held_out)]
    proc = subprocess.run(argv, env=peer_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"hsx evaluate failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--minutes", type=float, default=1.5, help="target training time")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64, help="target training batch")
    ap.add_argument("--train-rows", type=int, default=2000, help="rows extracted per run (drafter training data)")
    ap.add_argument("--held-out", type=int, default=16, help="held-out rows: prompts and teacher-forced samples")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--dflash-layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300, help="drafter training steps (each case)")
    ap.add_argument("--train-batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--cases", default=None, help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--peer-python", default=sys.executable, help="a Python with specforge 0.2.0")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    args.peer_python = os.path.abspath(args.peer_python)   # not resolved: a venv's python is a link to its base
    cases = args.cases.split(",") if args.cases else [c for c in CASES if args.device != "cpu" or "compute" not in c]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hsx-acceptance-"))
    t0 = time.monotonic()
    model = work / "target"
    tok, _, target_steps, losses = train_target(model, args.minutes, args.hidden, args.layers, args.seq, args.batch,
                                                device=args.device)
    tok.save_pretrained(model)
    index_for_specforge(model)
    print(f"target: H={args.hidden}, {args.layers} layers, {target_steps} steps, last loss "
          f"{losses[-1] if losses else None} ({time.monotonic() - t0:.0f}s)", flush=True)
    from bench.activation_stats import texts

    corpus = texts(0, 40000)       # the target's own corpus: its first 64 texts were held out of its training
    held_out = write_rows(work / "held_out.jsonl", tok, corpus[:64][:args.held_out], args.prompt_tokens, args.seq)
    train = write_rows(work / "train.jsonl", tok, corpus[64:64 + args.train_rows], args.prompt_tokens, args.seq)
    redis = LocalRedis(work / "redis").start()
    results = {}
    try:
        store = work / "store"
        layers = f"dflash:{args.dflash_layers}"
        for case in cases:
            compute, store_dtype = CASES[case]
            seconds = extract(redis.url, model, store, work / f"spool-{case}", case, train, layers, args.device, compute,
                              store_dtype, token_budget=max(4096, args.seq))
            extract(redis.url, model, store, work / f"spool-{case}", f"{case}-held-out", held_out, layers, args.device,
                    compute, store_dtype, token_budget=max(4096, args.seq))   # the teacher-forced figure's states
            print(f"{case}: extracted in {seconds:.0f}s", flush=True)
        baseline = None
        for case in cases:
            ckpt, train_seconds = train_drafter(args.peer_python, work, model, store, case, args)
            draft_config = ckpt / "draft_config.json"
            if baseline is None:   # the untrained drafter: the same config, at the trained block size
                untrained = work / "untrained_draft_config.json"
                untrained.write_text(json.dumps(json.loads(draft_config.read_text()) | {"block_size": args.block_size}))
                baseline = evaluate(args.peer_python, model, untrained, untrained, held_out, store,
                                    f"{case}-held-out", args)
                results["untrained"] = {"report": baseline}
                print(f"untrained: tau {baseline['decode']['tau']:.3f}", flush=True)
            report = evaluate(args.peer_python, model, ckpt, draft_config, held_out, store, f"{case}-held-out", args)
            results[case] = {"report": report, "train_seconds": train_seconds}
            (out / "drafter_acceptance.partial.json").write_text(json.dumps(results))   # kept if the call is cut
            print(f"{case}: trained {args.steps} steps in {train_seconds:.0f}s, tau {report['decode']['tau']:.3f}, "
                  f"speedup {report['decode']['speedup']:.2f}x", flush=True)
    finally:
        redis.stop()
    summary = {"config": vars(args), "target_steps": target_steps, "target_loss_last": losses[-1] if losses else None,
               "seconds": time.monotonic() - t0, "cases": results}
    (out / "drafter_acceptance.json").write_text(json.dumps(summary, indent=1))
    print("\n| run | compute | store | tau | distribution | target fwd/token | speedup | teacher-forced prefix "
          "| identical |\n|---|---|---|---|---|---|---|---|---|")
    for case, value in results.items():
        d, tf = value["report"]["decode"], value["report"].get("teacher_forced") or {}
        compute, store_dtype = CASES.get(case, ("-", "-"))
        print(f"| {case} | {compute} | {store_dtype or 'bfloat16'} | {d['tau']:.3f} | {d['tau_distribution']} | "
              f"{d['target_forwards_per_token']:.3f} | {d['speedup']:.2f}x | "
              f"{tf.get('accepted_prefix_mean', float('nan')):.3f} | {d['identical_prompts']}/{d['prompts']} |")
    print(f"total {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
