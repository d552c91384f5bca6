"""`hsx evaluate`: a drafter's acceptance length (tau) and speedup against its target, by greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

from hsx_cli.command import Command
from hsx_cli.common import REDIS_URL, STORE_FLAGS, store_settings
from hsx_cli.flags import Flag

FLAGS = (
    Flag("--model", "the target model's folder", required=True),
    Flag("--drafter", "a `specforge train` checkpoint (its <run_id>-step<N> folder or output_dir), or a draft config "
         ".json for an untrained drafter (the baseline)", required=True),
    Flag("--draft-config", "the drafter's config (default: draft_config.json beside the checkpoint)"),
    Flag("--dataset", "held-out prompts: any dataset file hsx produce reads (a row's prompt is its tokens before its "
         "first supervised token)"),
    Flag("--skip", "skip the dataset's first rows (those trained on)", type=int, default=0, min=0),
    Flag("--limit", "prompts to decode", type=int, default=16, min=1),
    Flag("--run", "a run: its last --held-out samples give the teacher-forced figure (and the prompts without "
         "--dataset); the report is kept with the run"),
    Flag("--held-out", "the run's last samples counted as held out", type=int, default=16, min=1),
    Flag("--anchors", "drafted blocks per held-out sample in the teacher-forced figure", type=int, default=8, min=1),
    Flag("--max-new-tokens", "tokens generated a prompt", type=int, default=64, min=1),
    Flag("--device", "cpu or cuda:N (one GPU)", default="cpu"),
    Flag("--dtype", "the target's and the drafter's dtype (default: float32 on the CPU, bfloat16 on a GPU)",
         choices=("float32", "bfloat16")),
    Flag("--peer-python", "a Python with SpecForge 0.2.0 and ./peers (default: scripts/peers.sh's venv, else this one)"),
    Flag("--json", "the report as JSON on stdout", type=bool),
    Flag("--store", "the run's store (default: the store the run recorded in Redis)"),
    *STORE_FLAGS,
    REDIS_URL,
)


def config(v):
    from hsx.errors import ConfigError
    from hsx_tools.evaluate import EvaluateConfig

    device = v["device"]
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError(f"--device {device!r}: want cpu or cuda:N")
    store = None
    if v["run"]:
        if v["store"]:
            store = store_settings(v)
        elif v["redis_url"]:
            from hsx_tools.export import ExportConfig, run_store

            store = run_store(ExportConfig(run=v["run"], format="specforge-dflash", out=Path("."), store=None,
                                           redis_url=v["redis_url"]))
    return EvaluateConfig(
        model=Path(v["model"]), drafter=Path(v["drafter"]),
        draft_config=Path(v["draft_config"]) if v["draft_config"] else None,
        dataset=Path(v["dataset"]) if v["dataset"] else None, skip=v["skip"], limit=v["limit"], run=v["run"],
        store=store, held_out=v["held_out"], anchors=v["anchors"], max_new_tokens=v["max_new_tokens"], device=device,
        dtype=v["dtype"] or ("float32" if device == "cpu" else "bfloat16"), json=v["json"],
        peer_python=v["peer_python"], redis_url=v["redis_url"])


def run(cfg) -> int:
    from hsx_tools.evaluate import evaluate, keep_with_run, report_lines

    report = evaluate(cfg, quiet=cfg.json)
    kept = keep_with_run(cfg, report) if cfg.run else None
    if cfg.json:
        print(json.dumps(report, indent=1))
    else:
        print("\n".join(report_lines(report)))
        if kept:
            print(f"kept with the run: {kept}" + (" (and in Redis, for hsx status)" if cfg.redis_url else ""))
    return 0


COMMAND = Command(
    "evaluate", "a drafter's acceptance length and speedup against its target (greedy speculative decoding)",
    "Decode held-out prompts twice in one process: target-only greedy (transformers' generate) and speculative "
    "(SpecForge 0.2.0's DFlash spec_generate: the drafter proposes a block, the target verifies it), in the Python "
    "that has SpecForge. Reports tau (mean tokens accepted per target forward, bonus included, and its distribution), "
    "target forwards per generated token, tokens/s of both and the speedup, and whether the outputs are identical. "
    "With --run, also the teacher-forced accepted prefix from the run's stored hidden states (no generation), and "
    "the report is written beside the run (evaluation.json) and summarised by hsx status.",
    FLAGS, config, run)
