"""`hsx export`: SpecForge and speculators files equal a plain HF forward; limit, shard, resume, store lookup."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from hsx.life.keys import RunKeys
from hsx_cli.main import main
from hsx_reader import RunDataset
from hsx_tools.export import specforge_path, speculators_path
from tests.test_reader_fixtures import assert_sample_matches


def _ids_by_position(run):
    return [ref.sample_id for ref in RunDataset(str(run.store), run.run).index.samples]


def test_specforge_dflash_with_limit_shard_and_resume(dflash_run, tmp_path, capsys):
    out, store = tmp_path / "sf", str(dflash_run.store)
    assert main(["export", "--run", dflash_run.run, "--for", "specforge-dflash", "--out", str(out), "--store", store,
                 "--shard", "00001", "--limit", "5"]) == 0
    assert len(list(out.rglob("*.ckpt"))) == 5
    assert main(["export", "--run", dflash_run.run, "--for", "specforge-dflash", "--out", str(out), "--store", store]) == 0
    assert "155 written, 5 already there, 160 in all" in capsys.readouterr().out
    ids = _ids_by_position(dflash_run)
    files = sorted(out.rglob("*.ckpt"))
    assert len(files) == 160 and {f.parent.name for f in files} == {"rows_000000000-000002000"}
    for position, sample_id in enumerate(ids):
        record = torch.load(specforge_path(out, position), weights_only=False, mmap=True)
        assert set(record) == {"input_ids", "loss_mask", "hidden_states"}
        assert record["input_ids"].dtype == record["loss_mask"].dtype == torch.int64
        assert record["hidden_states"].shape == (1, len(record["input_ids"]), 3 * 64)
        assert_sample_matches(dflash_run, sample_id, record["input_ids"], record["loss_mask"], record["hidden_states"][0])
    assert json.loads((out / "hsx_export.json").read_text())["layer_ids"] == dflash_run.layer_ids
    assert specforge_path(out, 4123).as_posix().endswith("rows_000004000-000006000/data_000004123.ckpt")


def _specforge_listing(folder) -> list[str]:
    """The feature files in the order SpecForge 0.2.0 trains them: every .ckpt under the folder, sorted as text
    (specforge/runtime/data_plane/offline_reader.py: os.walk, then files.sort())."""
    files = [os.path.join(root, n) for root, _, names in os.walk(folder) for n in names if n.endswith(".ckpt")]
    files.sort()
    return files


def test_specforge_export_trains_in_the_runs_order(dflash_run, tmp_path):
    """160 samples, 27 batches: SpecForge's text-sorted listing of the export is the run's index order."""
    out = tmp_path / "sf"
    assert main(["export", "--run", dflash_run.run, "--for", "specforge-dflash", "--out", str(out),
                 "--store", str(dflash_run.store)]) == 0
    in_place = [s["input_ids"].tolist() for s in RunDataset(str(dflash_run.store), dflash_run.run)]
    listed = [torch.load(f, weights_only=True)["input_ids"].tolist() for f in _specforge_listing(out)]
    assert len(listed) == len(in_place) == 160
    assert listed == in_place, next(i for i, (a, b) in enumerate(zip(listed, in_place, strict=True)) if a != b)
    # past one rows_ folder too: the listing of the paths of 30000 positions is number order
    paths = [specforge_path(out, i).as_posix() for i in range(0, 30000, 7)]
    assert sorted(paths) == paths
    # an export of the older unpadded naming is refused in one line (files would train in another order)
    old = tmp_path / "old"
    (old / "rows_0-2000").mkdir(parents=True)
    assert main(["export", "--run", dflash_run.run, "--for", "specforge-dflash", "--out", str(old),
                 "--store", str(dflash_run.store), "--limit", "2"]) == 2


def test_specforge_eagle3_keys(eagle3_run, tmp_path):
    out = tmp_path / "sf"
    assert main(["export", "--run", eagle3_run.run, "--for", "specforge-eagle3", "--out", str(out),
                 "--store", str(eagle3_run.store), "--limit", "40"]) == 0
    for position, sample_id in enumerate(_ids_by_position(eagle3_run)[:40]):
        record = torch.load(specforge_path(out, position), weights_only=False, mmap=True)
        assert set(record) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert_sample_matches(eagle3_run, sample_id, record["input_ids"], record["loss_mask"],
                              record["aux_hidden_state"][0], final=record["hidden_state"][0])


def test_one_specforge_record_for_the_export_and_the_peers_store_in_place(eagle3_run):
    """`hsx export` writes and hsx_peers.specforge's HsxFeatureStore serves one record layout, defined once
    (hsx_tools/specforgerecord.py); the peers' venvs see it on their path (tests/peerenv.py)."""
    from pathlib import Path

    from hsx_tools.specforgerecord import KEYS, NEEDS_FINAL, specforge_record

    root = Path(__file__).resolve().parents[1]
    defining = [str(p.relative_to(root)) for folder in ("hsx", "hsx_tools", "hsx_reader", "peers")
                for p in sorted((root / folder).rglob("*.py")) if '"aux_hidden_state"' in p.read_text()]
    assert defining == ["hsx_tools/specforgerecord.py"]
    assert "from hsx_tools.specforgerecord import KEYS, NEEDS_FINAL, specforge_record" in \
        (root / "peers" / "hsx_peers" / "specforge.py").read_text()
    ds = RunDataset(str(eagle3_run.store), eagle3_run.run)
    sample, sample_id = ds[0], ds.index.samples[0].sample_id
    for strategy, keys in KEYS.items():
        record = specforge_record(sample, strategy)
        assert list(record) == [k for k in ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state", "hidden_states",
                                            "target_last_hidden_states") if k in keys]
        assert record["input_ids"].dtype == record["loss_mask"].dtype == torch.int64
        hidden = record["aux_hidden_state" if strategy == "eagle3" else "hidden_states"][0]
        final = record.get("hidden_state", record.get("target_last_hidden_states", [None]))[0]
        assert (final is not None) == (strategy in NEEDS_FINAL)
        assert_sample_matches(eagle3_run, sample_id, record["input_ids"], record["loss_mask"], hidden, final=final)
    with pytest.raises(ValueError, match="strategy must be one of"):
        specforge_record(sample, "medusa")


def test_speculators_eagle3_layout_and_prenorm_slot(eagle3_run, tmp_path):
    out = tmp_path / "spec"
    assert main(["export", "--run", eagle3_run.run, "--for", "speculators-eagle3", "--out", str(out),
                 "--store", str(eagle3_run.store), "--limit", "30"]) == 0
    body = eagle3_run.hf[0]
    rows = [json.loads(line) for line in (out / "dataset.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    for position, sample_id in enumerate(_ids_by_position(eagle3_run)[:30]):
        data = load_file(str(speculators_path(out, position)))
        hs, T = data["hidden_states"], len(data["token_ids"])
        assert hs.shape == (T, 4, 64) and data["token_ids"].dtype == torch.int64
        assert rows[position] == {"input_ids": data["token_ids"].tolist(), "loss_mask": data["loss_mask"].tolist(),
                                  "seq_len": T}
        assert_sample_matches(eagle3_run, sample_id, data["token_ids"], data["loss_mask"], hs[:, :3].flatten(1))
        # The last slot stands in for the pre-norm state: the target's own final norm maps it to HF's (normed)
        # last hidden state, to within eps / (2 * mean(x^2)) relative; the tiny random model's activations are
        # small (mean(x^2) ~ 1e-3), a real model's last layer makes that < 1e-6.
        with torch.no_grad():
            torch.testing.assert_close(body.norm(hs[:, 3].float()), eagle3_run.expected[sample_id]["final"],
                                       atol=1e-4, rtol=2e-3)
    assert json.loads((out / "hsx_export.json").read_text())["layer_ids"] == [2, 4, 5]


def test_speculators_refuses_a_run_without_final_state(dflash_run, tmp_path, capsys):
    ids = ",".join(map(str, dflash_run.layer_ids))
    assert main(["export", "--run", dflash_run.run, "--for", "speculators-eagle3", "--out", str(tmp_path / "o"),
                 "--store", str(dflash_run.store)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"run 'rdflash' cannot feed speculators-eagle3: it needs the final hidden state (the last "
                        f"hidden_states slot), and the run stored layers [{ids}] only; produce with --layers {ids}+final "
                        f"(or eagle3)") and "\n" not in err


def test_store_comes_from_the_runs_manifest_in_redis(dflash_run, r, redis_env, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HSX_STORE", raising=False)
    assert main(["export", "--run", dflash_run.run, "--for", "specforge-dflash", "--out", str(tmp_path / "o")]) == 2
    assert "pass --store" in capsys.readouterr().err
    r.set(RunKeys(dflash_run.run).manifest, (dflash_run.store / dflash_run.run / "manifest.json").read_text())
    assert main(["export", "--run", dflash_run.run, "--for", "specforge-dflash", "--out", str(tmp_path / "o"),
                 "--limit", "3"]) == 0
    assert len(list((tmp_path / "o").rglob("*.ckpt"))) == 3


def test_key_names_follow_the_trainer_not_the_run(eagle3_run, dflash_run, tmp_path, capsys):
    # An eagle3 run (final stored) feeds SpecForge's DFlash and DSpark too; a dflash run cannot feed EAGLE-3/DSpark.
    ids = _ids_by_position(eagle3_run)
    for target, keys in (("specforge-dflash", {"input_ids", "loss_mask", "hidden_states"}),
                         ("specforge-dspark", {"input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"})):
        out = tmp_path / target
        assert main(["export", "--run", eagle3_run.run, "--for", target, "--out", str(out),
                     "--store", str(eagle3_run.store), "--limit", "4"]) == 0
        for position in range(4):
            record = torch.load(specforge_path(out, position), weights_only=True)
            assert set(record) == keys
            assert_sample_matches(eagle3_run, ids[position], record["input_ids"], record["loss_mask"],
                                  record["hidden_states"][0], final=record.get("target_last_hidden_states", [None])[0])
    for target, missing in (("specforge-eagle3", "hidden_state"), ("specforge-dspark", "target_last_hidden_states")):
        assert main(["export", "--run", dflash_run.run, "--for", target, "--out", str(tmp_path / "no"),
                     "--store", str(dflash_run.store)]) == 2
        assert f"cannot feed {target}: it needs the final hidden state ({missing})" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    assert main(["export", "--run", dflash_run.run, "--out", str(tmp_path / "o"), "--store", str(dflash_run.store)]) == 2
    assert "say which trainer the export is for: --for" in capsys.readouterr().err


def test_speculators_table_is_torch_format_with_token_freq(eagle3_run, tmp_path):
    # speculators' own load_from_disk reads it (tests/test_peers.py); here: the torch format flag, the int64
    # columns and the loss-masked token counts.
    import pyarrow as pa

    out = tmp_path / "spec"
    assert main(["export", "--run", eagle3_run.run, "--for", "speculators-dflash", "--out", str(out),
                 "--store", str(eagle3_run.store), "--limit", "10"]) == 0
    assert json.loads((out / "dataset" / "state.json").read_text())["_format_type"] == "torch"
    with pa.OSFile(str(out / "dataset" / "data-00000-of-00001.arrow")) as fh:
        table = pa.ipc.open_stream(fh).read_all()
    assert table.schema.field("input_ids").type == pa.list_(pa.int64()) and table.num_rows == 10
    freq = torch.load(out / "dataset" / "token_freq.pt", weights_only=True)
    want: dict[int, int] = {}
    for r in table.to_pylist():
        for t, kept in zip(r["input_ids"], r["loss_mask"], strict=True):
            if kept:
                want[t] = want.get(t, 0) + 1
    assert freq == want and sum(freq.values()) > 0


def test_specforge_exports_write_the_draft_config_and_its_train_line(eagle3_run, dflash_run, tmp_path, capsys):
    # SpecForge's own generated DFlash draft reads one layer and it generates none for DSpark; the file hsx
    # writes reads the run's layers (tests/test_specforge_train.py trains with it, unchanged). Here: its fields.
    from hsx.runspec.config import ConfigError
    from hsx_tools.draftconfig import draft_config

    for run, target, architecture in ((dflash_run, "specforge-dflash", "DFlashDraftModel"),
                                      (eagle3_run, "specforge-dspark", "DSparkDraftModel"),
                                      (eagle3_run, "specforge-eagle3", "LlamaForCausalLMEagle3")):
        out = tmp_path / target
        capsys.readouterr()
        assert main(["export", "--run", run.run, "--for", target, "--out", str(out), "--store", str(run.store),
                     "--limit", "2"]) == 0
        draft = json.loads((out / "draft_config.json").read_text())
        assert json.loads((out / "hsx_export.json").read_text())["draft_config"] == "draft_config.json"
        assert draft["architectures"] == [architecture] and draft["hidden_size"] == 64 and draft["vocab_size"] == 512
        assert draft["num_hidden_layers"] == 1 and draft["num_attention_heads"] == 4
        assert draft["num_key_value_heads"] == 2
        if target == "specforge-eagle3":
            assert draft["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": run.layer_ids}
            assert draft["draft_vocab_size"] == 512   # SpecForge's 32000, at most the target's vocabulary
        else:
            assert draft["dflash_config"]["target_layer_ids"] == run.layer_ids and draft["block_size"] == 16
            assert draft["num_target_layers"] == json.loads((run.model / "config.json").read_text())["num_hidden_layers"]
        if target == "specforge-dspark":   # 2 KV heads < 4 query heads: DSpark's default grouped attention
            assert draft["dflash_config"]["attention_mode"] == "gqa"
        assert (f"train: specforge train -c run.yaml model.target_model_path={run.model} "
                f"model.draft_model_config={(out / 'draft_config.json').resolve()} "
                f"data.hidden_states_path={out.resolve()} training.strategy={target.split('-')[1]}"
                in capsys.readouterr().out)
    with pytest.raises(ConfigError, match=r"EAGLE-3 draft reads exactly 3 layers, the run has 2 \(\[1, 3\]\)"):
        draft_config(str(eagle3_run.model), "eagle3", [1, 3])
