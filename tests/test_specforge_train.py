"""SpecForge 0.2.0's own trainer (`specforge train`) trains EAGLE-3, DFlash and DSpark drafters of the tiny
8-layer model on hsx data, on the CPU, in SpecForge's venv (scripts/peers.sh): from `hsx export --for
specforge-*` folders and from the runs read in place (`python -m hsx_peers.specforge train`, HsxFeatureStore),
a bf16 run in a local store and an FP8-stored one (e4m3 + per-token scales) on S3 (`rclone serve s3`). The draft model
config is hsx's, unchanged: an export's `draft_config.json` through the exact line `hsx export` printed, and
in place the one the command writes from the run's manifest (equal to the export's). What is replaced for the
CPU, and why, is in tests/peers/train_specforge.py (EAGLE-3's triton loss kernel only). The in-place
command's refusals (a missing run; a config that would launch SpecForge's own CLI processes) are checked too.

Each run sees the same SAMPLES samples at every step (batch = the run, one epoch a step), so a working
trainer's loss falls from the first step to the last; it must also be finite at every step, and reading a
run in place must train exactly as its export does (the same loss at every step)."""

from __future__ import annotations

import json
import math

import pytest

from hsx.runspec.config import StoreSettings
from hsx_cli.main import main
from hsx_reader import RunDataset
from hsx_tools.demo import sample_dataset
from hsx_tools.tinymodel import build_tiny_model, write_weight_index
from tests.conftest import _new_bucket
from tests.peerenv import run_peer
from tests.pipeline import run_pipeline

SAMPLES = 8
STEPS = 5
ALGORITHMS = {  # strategy -> config changes (the draft config is the one hsx writes, unchanged)
    "eagle3": {"training": {"ttt_length": 2}},
    "dflash": {"training": {"num_anchors": 16}, "model": {"draft_block_size": 4}},
    "dspark": {"training": {"num_anchors": 16}},   # SpecForge refuses model.draft_block_size for dspark: 16
}


def _specforge_target(model):
    """The tiny model as SpecForge 0.2.0 reads a target: its TargetHead loads the LM head through a
    ``*.index.json`` (real checkpoints are sharded; the tiny one is a single file). build_tiny_model writes one
    (hsx_tools.tinymodel.write_weight_index, issue 41 item 5: a newcomer wrote it by hand); a target trained
    elsewhere (tests/test_evaluate.py's sharp one) gets it from the same function. hsx reads the single file."""
    write_weight_index(model)
    assert "model.embed_tokens.weight" in json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    return model


def _train_line(out: str) -> list[str]:
    """The overrides of the `train: specforge train -c run.yaml ...` line `hsx export` printed."""
    line = next(x for x in out.splitlines() if x.startswith("train: specforge train -c run.yaml "))
    return line.split()[5:]


def _config(tmp_path, name, target, strategy, hidden_states_path):
    config_changes = ALGORITHMS[strategy]
    config = {
        # the tiny target ties its embeddings: its LM head is the embedding table
        "model": {"target_model_path": str(target), "lm_head_key": "model.embed_tokens.weight"},
        "data": {"hidden_states_path": hidden_states_path, "max_length": 512, "dataloader_num_workers": 0,
                 "cache_dir": str(tmp_path / "cache")},
        "training": {"strategy": strategy, "batch_size": SAMPLES, "num_epochs": STEPS, "max_steps": STEPS,
                     "learning_rate": 1e-3, "lr_scheduler": "constant", "attention_backend": "sdpa",
                     "fsdp_sharding": "NO_SHARD",   # DDP on gloo: FSDP1 refuses a CPU (train_specforge.py)
                     "log_interval": 1, "seed": 0},
        "run_id": name, "output_dir": str(tmp_path / f"ckpt-{name}"),
    }
    for section, values in config_changes.items():
        config[section].update(values)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
def test_specforge_trains_on_hsx_data(redis_server, rclone_server, tmp_path, capsys):
    """SpecForge's own trainer on hsx runs, exported and in place; the S3 run on `rclone serve s3`, a real S3 server
    (issue 28: a trainer in place on the server hsx's checks must hold on)."""
    model = build_tiny_model(tmp_path / "tiny8", num_layers=8, sample_path=sample_dataset())
    assert (model / "model.safetensors.index.json").is_file()  # written by hsx, not by this test
    target = _specforge_target(model)
    dataset = tmp_path / "conversations.jsonl"
    dataset.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:SAMPLES]))
    s3 = StoreSettings(url=f"s3://{_new_bucket(rclone_server)}/runs", endpoint_url=rclone_server, region="us-east-1")
    stores = {"bf16": ("bfloat16", str(tmp_path / "store"), "local"), "fp8": ("float8_e4m3", s3, "S3 (rclone)")}
    cases, runs, drafts = [], [], {}
    for dtype, (store_dtype, store, where) in stores.items():
        run = f"sf-{dtype}"
        run_pipeline(redis_server.url, model, store, tmp_path / f"spool-{run}", run=run, dataset=dataset,
                     layers="eagle3", dtype="bfloat16", store_dtype=store_dtype)
        url = store.url if isinstance(store, StoreSettings) else store
        endpoint = rclone_server if isinstance(store, StoreSettings) else None
        reader = RunDataset(StoreSettings(url=url, endpoint_url=endpoint), run)
        assert len(reader) == SAMPLES and reader.index.layer_ids == [1, 3, 4]
        for strategy in ALGORITHMS:
            out = tmp_path / "export" / f"{strategy}-{dtype}"
            capsys.readouterr()
            assert main(["export", "--run", run, "--for", f"specforge-{strategy}", "--out", str(out), "--store", url,
                         *(["--s3-endpoint-url", endpoint] if endpoint else [])]) == 0
            # the draft config hsx wrote beside the export, and the exact line that trains with it
            overrides = _train_line(capsys.readouterr().out)
            draft = out / "draft_config.json"
            assert json.loads((out / "hsx_export.json").read_text())["draft_config"] == draft.name
            assert overrides == [f"model.target_model_path={model}", f"model.draft_model_config={draft.resolve()}",
                                 f"data.hidden_states_path={out.resolve()}", f"training.strategy={strategy}"]
            drafts[strategy, dtype] = json.loads(draft.read_text())
            for mode, path, hsx_store in [
                (f"export ({where} run)", str(out), None),
                (f"in place, {where}", f"hsx://{run}", {"store": url, "fetch": "range", "endpoint_url": endpoint}),
            ]:
                name = f"{strategy}-{dtype}-{'export' if hsx_store is None else 'inplace'}"
                config = _config(tmp_path, name, target, strategy, path)
                cases.append((strategy, dtype, mode))
                # in place: no draft config given; the command writes the run's own to <output_dir>
                runs.append({"argv": ["train", "-c", str(config), *(overrides if hsx_store is None else [])],
                             "hsx_store": hsx_store})
    # refused in one line, exit 2, before any step: a run the store lacks, and a config that would make
    # specforge train launch processes of its own CLI (they would not read hsx://)
    local = {"store": str(tmp_path / "store"), "fetch": "range"}
    nosuch = _config(tmp_path, "nosuch", target, "dflash", "hsx://nosuchrun")
    two_ranks = tmp_path / "two-ranks.json"
    two_ranks.write_text(json.dumps(json.loads(_config(tmp_path, "two", target, "dflash", "hsx://sf-bf16").read_text())
                                    | {"deployment": {"trainer": {"nproc_per_node": 2}}}))
    refusals = {"nosuchrun/manifest.json: no manifest": nosuch, "run one process per rank under torchrun": two_ranks}
    runs += [{"argv": ["train", "-c", str(path)], "hsx_store": local, "refused": True} for path in refusals.values()]
    got = run_peer("specforge", "train_specforge.py", json.dumps(runs), cwd=tmp_path)
    for says, refused in zip(refusals, got["refusals"], strict=True):
        assert refused["rc"] == 2 and refused["losses"] == [], refused
        assert len(refused["errors"]) == 1 and says in refused["errors"][0], refused
    report = dict(zip(cases, got["losses"], strict=True))
    print("\nspecforge train (SpecForge 0.2.0, CPU) on hsx data:")
    print(f"{'trainer':<10}{'run':<6}{'data':<28}{'steps':>6}{'first loss':>12}{'last loss':>12}{'seconds':>9}")
    for ((strategy, dtype, mode), losses), secs in zip(report.items(), got["seconds"], strict=True):
        print(f"{strategy:<10}{dtype:<6}{mode:<28}{len(losses):>6}{losses[0]:>12.6f}{losses[-1]:>12.6f}{secs:>9}")
    for (strategy, dtype, mode), losses in report.items():
        case = (strategy, dtype, mode)
        assert len(losses) == STEPS, (case, losses)
        assert all(math.isfinite(x) for x in losses), (case, losses)
        assert losses[-1] < losses[0], (case, losses)
        if mode.startswith("in place"):  # the same samples, read in place: the same training, step for step
            written = json.loads((tmp_path / f"ckpt-{strategy}-{dtype}-inplace" / "draft_config.json").read_text())
            assert written == drafts[strategy, dtype], case   # the run's manifest gives the export's draft config
            export = next(v for (a, d, m), v in report.items() if (a, d) == (strategy, dtype) and m.startswith("export"))
            assert losses == pytest.approx(export, rel=1e-5), (case, losses, export)

