"""A mixture: several sources in one run (`--dataset` repeated, or `--mixture FILE`), sample ids namespaced by
source, the mixture in the manifest; a single `--dataset` run keeps its ids and manifest as before."""

import json

import pytest

from hsx.life import ledger
from hsx.life.windowrecords import window_records
from hsx.monitor.planstate import resume_command  # what status prints to resume a half-planned run
from hsx.prep import MixtureError
from hsx.runspec import Manifest
from hsx.runspec.manifest import ManifestMismatch
from hsx.store import open_store
from hsx_cli.flags import resolve
from hsx_cli.main import build_parser
from producer.produce import produce
from tests.pipeline import planned_specs


def chat(i, text="hello"):
    return {"messages": [{"role": "user", "content": f"{text} {i}"}, {"role": "assistant", "content": f"answer {i}"}]}


def write(path, rows):
    """A JSONL file: each row as JSON, a string as the line itself."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def produce_cli(redis_url, model, store, run, *args):
    """`hsx produce` as its command line builds it (flags parsed, config built), run in this process."""
    from hsx_cli import produce as produce_cmd

    argv = ["produce", "--run", run, "--model", str(model), "--store", str(store), "--redis-url", redis_url,
            "--layers", "dflash:3", "--token-budget", "1024", "--max-length", "1024", "--pad-multiple", "1",
            "--dtype", "float32", "--tokenise-workers", "1", "--window-rows", "4", *map(str, args)]
    return produce(produce_cmd.COMMAND.config(resolve(produce_cmd.FLAGS, build_parser().parse_args(argv))))


def planned_ids(r, run):
    return sorted(s for spec in planned_specs(r, run).values() for s in spec.sample_ids)


def test_two_sources_with_the_same_ids_do_not_collide(r, redis_server, tiny_model, tmp_path):
    # Before mixtures, the second --dataset replaced the first: 3 samples planned, the first file's rows lost.
    a = write(tmp_path / "a.jsonl", [{"id": f"x{i}", **chat(i)} for i in range(3)])
    b = write(tmp_path / "b.jsonl", [{"id": f"x{i}", **chat(i, "other")} for i in range(2)] + [chat(9)])
    report = produce_cli(redis_server.url, tiny_model, tmp_path / "store", "mix2", "--dataset", a, "--dataset", b)
    assert report.samples == 6 and report.tokenise.rejected_rows == 0
    assert planned_ids(r, "mix2") == ["a/x0", "a/x1", "a/x2", "b/2", "b/x0", "b/x1"]
    lines = report.lines()
    assert [line.split(",")[0] for line in lines if line.startswith("  source ")] == \
        ["  source a: 3 rows read", "  source b: 3 rows read"]
    manifest = ledger.get_manifest(r, "mix2")
    assert [(s["name"], s["dataset"]) for s in manifest.mixture] == [("a", str(a)), ("b", str(b))]
    assert manifest.dataset == str(a)
    assert f"--dataset {a} --dataset {b} --model" in resume_command(manifest, "mix2")
    # every batch holds one source's samples (each source starts a window)
    for spec in planned_specs(r, "mix2").values():
        assert len({sid.split("/")[0] for sid in spec.sample_ids}) == 1, spec.sample_ids
    records = [json.loads(raw) for _, raw in sorted(window_records(r, "mix2").items())]
    assert [rec["source"] for rec in records] == ["a", "b"]


def test_a_mixture_file_caps_shares_columns_and_template_kwargs(r, redis_server, tiny_model, tmp_path):
    write(tmp_path / "chat.jsonl", [chat(i) for i in range(10)])
    write(tmp_path / "alpaca.jsonl", [{"instruction": f"do {i}", "output": f"done {i}"} for i in range(4)])
    write(tmp_path / "glaive.jsonl", [{"system": "SYSTEM: be brief", "chat": f"USER: q{i}\n\nASSISTANT: a{i} <|endoftext|>"}
                                      for i in range(6)] + [{"system": "", "chat": "nothing"}])
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"sources": [
        {"name": "chat", "dataset": "chat.jsonl", "rows": 3, "seed": 7},
        {"name": "alpaca", "dataset": "alpaca.jsonl", "columns": "user=instruction,assistant=output",
         "template_kwargs": {"enable_thinking": False}},
        {"dataset": "glaive.jsonl", "share": 0.5, "seed": 1},
    ]}))
    report = produce_cli(redis_server.url, tiny_model, tmp_path / "store", "mixf", "--mixture", mix,
                         "--max-reject-share", "0.5")
    ids = planned_ids(r, "mixf")
    by_source = {name: [i for i in ids if i.startswith(name + "/")] for name in ("chat", "alpaca", "glaive")}
    assert len(by_source["chat"]) == 3 and len(by_source["alpaca"]) == 4 and len(ids) == report.samples
    # 4 of glaive's 7 rows drawn (share 0.5, rounded), its bad row rejected if drawn
    assert report.tokenise.rows == 3 + 4 + 4 and len(by_source["glaive"]) + report.tokenise.rejected_rows == 4
    manifest = Manifest.load(open_store(str(tmp_path / "store")), "mixf")
    assert manifest.dataset == str(mix.resolve())
    assert f"--mixture {mix.resolve()} --model" in resume_command(manifest, "mixf")
    sources = {s["name"]: dict(s) for s in manifest.mixture}
    assert sources["chat"]["rows"] == 3 and sources["chat"]["seed"] == 7
    assert sources["alpaca"]["columns"] == {"user": ["instruction"], "assistant": ["output"]}
    assert sources["alpaca"]["template_kwargs"] == {"enable_thinking": False}
    assert sources["glaive"]["share"] == 0.5 and len(sources["glaive"]["fingerprint"]) == 64
    # the same draw again: the same rows (ids), nothing new to enqueue
    again = produce_cli(redis_server.url, tiny_model, tmp_path / "store", "mixf", "--mixture", mix,
                        "--max-reject-share", "0.5")
    assert again.enqueued == 0 and planned_ids(r, "mixf") == ids
    # a source moved to another folder is the same source (known by its bytes, as one --dataset is)
    (tmp_path / "moved").mkdir()
    (tmp_path / "chat.jsonl").rename(tmp_path / "moved" / "chat.jsonl")
    spec = json.loads(mix.read_text())
    spec["sources"][0]["dataset"] = "moved/chat.jsonl"
    mix.write_text(json.dumps(spec))
    moved = produce_cli(redis_server.url, tiny_model, tmp_path / "store", "mixf", "--mixture", mix,
                        "--max-reject-share", "0.5")
    assert moved.enqueued == 0 and planned_ids(r, "mixf") == ids
    # a changed mixture is another run: refused, naming the mixture
    spec = json.loads(mix.read_text())
    spec["sources"][0]["seed"] = 8
    mix.write_text(json.dumps(spec))
    with pytest.raises(ManifestMismatch, match="mixture: run has"):
        produce_cli(redis_server.url, tiny_model, tmp_path / "store", "mixf", "--mixture", mix,
                    "--max-reject-share", "0.5")


# The keys of a single-dataset manifest as hsx wrote them before mixtures (main at 8defc92).
OLD_KEYS = {"format", "run", "model", "model_config_hash", "model_type", "num_layers", "hidden_size", "layer_preset",
            "layer_ids", "store_final", "dtype", "store_dtype", "codec", "compute_dtype", "fp8_accumulation",
            "max_length", "overlong", "token_budget", "pad_multiple", "max_batch_rows", "batches_per_shard",
            "window_rows", "dataset", "dataset_fingerprint", "chat_template_hash", "template_kwargs", "columns",
            "pad_token_id", "store_url", "store", "limits", "hsx_version", "created", "incarnation", "model_weights"}


def test_one_dataset_keeps_its_ids_manifest_and_window_records(r, redis_server, tiny_model, tmp_path):
    a = write(tmp_path / "a.jsonl", [{"id": "x0", **chat(0)}, chat(1), chat(2)])
    produce_cli(redis_server.url, tiny_model, tmp_path / "store", "one", "--dataset", a)
    assert planned_ids(r, "one") == ["1", "2", "x0"]
    raw = json.loads(open_store(str(tmp_path / "store")).get_bytes("one/manifest.json"))
    # (issue 40's prefix_* keys are written where shared prefixes are computed once, a mixture or not)
    assert {k for k in raw if not k.startswith("prefix_")} == OLD_KEYS
    assert all("source" not in json.loads(rec) for rec in window_records(r, "one").values())
    # a run planned before mixtures (its manifest has no mixture key) resumes: same manifest, nothing new
    again = produce_cli(redis_server.url, tiny_model, tmp_path / "store", "one", "--dataset", a)
    assert again.enqueued == 0 and again.batches >= 1


@pytest.mark.parametrize("spec, words", [
    ({"sources": []}, "no sources"),
    ({"sources": [{"dataset": "a.jsonl"}, {"dataset": "sub/a.jsonl"}]}, "two sources are named 'a'"),
    ({"sources": [{"dataset": "a.jsonl", "rows": 2, "share": 0.5}]}, "not both"),
    ({"sources": [{"dataset": "a.jsonl", "share": 1.5}]}, r"share must be a number in \(0, 1\]"),
    ({"sources": [{"dataset": "a.jsonl", "name": "a/b"}]}, "source name 'a/b'"),
    ({"sources": [{"dataset": "a.jsonl", "weight": 2}]}, "unknown key 'weight'"),
    ({"sources": [{"dataset": "a.jsonl", "columns": "user"}]}, "is not key=column"),
    ({"sources": [{"dataset": "missing.jsonl"}]}, "source missing: dataset .* does not exist"),
    ("sources: [dataset: a.jsonl", "not YAML"),
    ("sources:\n  - !!python/object/apply:os.system [echo hi]", "not YAML"),
])
def test_a_bad_mixture_is_one_line_naming_the_fix(tmp_path, spec, words):
    from hsx.prep import load_mixture

    write(tmp_path / "a.jsonl", [chat(0)])
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "a.jsonl", [chat(0)])
    name = "mix.yaml" if isinstance(spec, str) else "mix.json"
    (tmp_path / name).write_text(spec if isinstance(spec, str) else json.dumps(spec))
    with pytest.raises(Exception, match=words) as err:
        load_mixture(tmp_path / name).resolved()
    assert "\n" not in str(err.value)
    assert isinstance(err.value, MixtureError) or "does not exist" in str(err.value)


def test_a_yaml_mixture_is_the_same_mixture(tmp_path):
    from hsx.prep import load_mixture

    write(tmp_path / "a.jsonl", [chat(0)])
    (tmp_path / "mix.json").write_text(json.dumps({"sources": [{"name": "x", "dataset": "a.jsonl", "rows": 1,
                                                                "template_kwargs": {"enable_thinking": False}}]}))
    (tmp_path / "mix.yaml").write_text("sources:\n  - name: x\n    dataset: a.jsonl\n    rows: 1\n"
                                       "    template_kwargs: {enable_thinking: false}\n")
    from_json, from_yaml = load_mixture(tmp_path / "mix.json"), load_mixture(tmp_path / "mix.yaml")
    assert from_yaml.sources == from_json.sources and from_yaml.sources[0].template_kwargs == {"enable_thinking": False}


def test_hsx_run_passes_every_source_to_produce(tmp_path):
    # Before, `hsx run --dataset a --dataset b` handed produce only b.
    from hsx_cli import produce as produce_cmd
    from hsx_cli import run as run_cmd

    a, b = write(tmp_path / "a.jsonl", [chat(0)]), write(tmp_path / "b.jsonl", [chat(1)])
    common = ["--model", "m", "--store", str(tmp_path / "store"), "--gpus", "cpu", "--state-dir", str(tmp_path / "st")]
    for given, dataset in ((["--dataset", str(a), "--dataset", str(b)], a),
                           (["--mixture", str(write(tmp_path / "mix.json", [{"sources": [{"dataset": "a.jsonl"}]}]))],
                            tmp_path / "mix.json")):
        cfg = run_cmd.COMMAND.config(resolve(run_cmd.FLAGS, build_parser().parse_args(["run", *given, *common])))
        argv = list(cfg.launch.produce)
        assert [argv[i + 1] for i, x in enumerate(argv) if x in ("--dataset", "--mixture")] == given[1::2]
        assert cfg.launch.same_plan["dataset"] == str(dataset)
        v = resolve(produce_cmd.FLAGS, build_parser().parse_args(["produce", *argv, "--redis-url", "redis://127.0.0.1:1/0"]))
        assert produce_cmd.config(v).dataset == dataset
