"""`hsx demo` and `hsx demo-assets`: the embedded default on this machine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hsx_cli.command import Command
from hsx_cli.flags import Flag

DEMO_FLAGS = (
    Flag("--store", "local output directory", default="hsx-out"),
    Flag("--workdir", "scratch for Redis data, spool and the tiny model", default=".hsx"),
    Flag("--samples", "use only the first N shipped conversations", type=int, min=1),
    Flag("--look", "after a demo: start its Redis again from WORKDIR/redis (data kept), print `hsx status` and serve "
         "the dashboard until Ctrl-C", type=bool),
)
ASSET_FLAGS = (Flag("--out", "folder to write tiny-qwen3/ and sample_conversations.jsonl into", required=True),)


@dataclass(frozen=True)
class DemoConfig:
    store: Path
    workdir: Path
    samples: int | None
    look: bool = False


def run_demo(cfg: DemoConfig) -> int:
    from hsx_tools.demo import look
    from hsx_tools.demo import run_demo as demo

    if cfg.look:
        return look(cfg.workdir)
    return demo(cfg.store, cfg.workdir, samples=cfg.samples)


def run_assets(out: Path) -> int:
    import filecmp
    import shutil

    from hsx_tools.demo import sample_dataset
    from hsx_tools.tinymodel import build_tiny_model

    model = build_tiny_model(out / "tiny-qwen3", sample_path=sample_dataset())
    dataset = out / "sample_conversations.jsonl"
    if not dataset.exists() or not filecmp.cmp(sample_dataset(), dataset, shallow=False):
        shutil.copyfile(sample_dataset(), dataset)
    print(f"model: {model}\ndataset: {dataset}")
    return 0


DEMO = Command(
    "demo", "the embedded default: the whole pipeline on this machine, tiny model, no network",
    "Starts a private redis-server if none is reachable at HSX_REDIS_URL, builds a tiny random Qwen3 model and a "
    "real tokenizer locally, plans the shipped sample conversations, and runs a worker (CPU) and two uploaders "
    "as processes into a local-directory store, then prints the next commands. --look, after it: the demo's Redis "
    "again (its data kept in WORKDIR/redis), `hsx status` and the dashboard.",
    DEMO_FLAGS, lambda v: DemoConfig(Path(v["store"]), Path(v["workdir"]), v["samples"], v["look"]), run_demo)

ASSETS = Command(
    "demo-assets", "write the embedded default's tiny model and sample conversations to a folder",
    "Builds the tiny random Qwen3 model (with its tokenizer) and copies the shipped sample conversations into "
    "OUT, for `hsx produce` and workers that run as separate processes or containers (docker-compose.cpu.yml). "
    "Does nothing that is already there.",
    ASSET_FLAGS, lambda v: Path(v["out"]), run_assets)
