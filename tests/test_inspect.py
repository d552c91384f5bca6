import json
import subprocess
import sys

from hsx_tools.demo import sample_dataset
from tests.waiting import scaled


def test_inspect_prints_formats_reasons_histogram_samples_and_estimate_plain_when_piped(tiny_model, tmp_path):
    rows = [json.loads(line) for line in sample_dataset().read_text().splitlines() if line.strip()]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:40])
                    + "{broken\n" + "[" * 100_000 + "]" * 100_000 + "\n" + json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                                  {"from": "gpt", "value": "hello there"}]}) + "\n")
    out = subprocess.run([sys.executable, "-m", "hsx_cli.main", "inspect", "--dataset", str(data), "--model",
                          str(tiny_model), "--layers", "dflash:3", "--samples", "2", "--tokenise-workers", "1",
                          "--gpu-usd-per-hour", "3", "--storage-usd-per-tb-month", "20",
                          "--store-dtype", "float8_e4m3", "--codec", "zstd", "--compute-dtype", "float8"],
                         capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "\x1b[" not in text                                   # piped: no terminal colours
    assert "rows: 43 read, 41 kept" in text and "2 rejected" in text
    formats = dict(part.rsplit(" ", 1) for part in text.split("by format: ", 1)[1].split("\n", 1)[0].split(", "))
    assert formats["unreadable"] == "2" and sum(map(int, formats.values())) == 43 and "sharegpt" in formats
    assert "row 41: " in text                                    # the broken line, quoted 1-based
    # how the template's turns are located, said once per template
    assert "template: turns start where the generation prompt rendered after their context ('<|im_start|>assistant\\n'" in text
    assert "  assistant turns of the first 43 rows located by the generation prompt rendered after their context: " in text
    assert "row 42: line 42 of d.jsonl is nested too deeply" in text   # 100k "[": was a RecursionError
    assert "token lengths (kept samples):" in text and "#" in text
    samples = [line for line in text.splitlines() if line.startswith("--- sample ")]
    assert len(samples) == 2 and "in the loss mask: [[...]]" in samples[0]
    assert text.count("[[") >= 2 and "]]" in text
    assert "plan: " in text and "padding" in text and "GPU-hours" in text and "a month at $20/TB-month" in text
    assert ("  trainers: specforge-dflash (hsx export --for); not specforge-eagle3, specforge-dspark, speculators-eagle3, "
            "speculators-dflash: they need the final state (--layers dflash:3+final)\n") in text
    assert "at $3/GPU-hour" in text
    # tiny model: 3 layers x 64 values, FP8 (1 byte + a 4-byte scale a layer) x zstd's measured 0.82, + 5 of ids/mask
    assert "x float8_e4m3 + zstd = 172 B a token" in text
    # FP8 storage and compute: what each costs against bf16, side by side, and where the run's own figures go.
    precision = [line for line in text.splitlines() if line.startswith("  precision: ")]
    assert len(precision) == 2 and "FP8 compute ~1.1 % rel L2" in precision[0] and "compute_error.json" in precision[0]
    assert "(fp32 accumulation" in precision[0]                  # the default
    assert "FP8 storage ~2.6 % rel L2" in precision[1] and "store_error.json" in precision[1]


def test_precision_lines_follow_the_accumulation_asked_for():
    from hsx_tools.planestimate import precision_lines

    fast = precision_lines("bfloat16", "float8", "fast")
    assert "FP8 compute ~1.5 % rel L2" in fast[0] and "(fast accumulation" in fast[0]
    assert not any("FP8 storage" in line for line in fast)
    assert precision_lines("bfloat16", "bfloat16") == []          # a bf16 run costs nothing against bf16


def test_inspect_takes_produces_own_flag_declarations_and_refuses_alike(capsys):
    from hsx_cli import inspect, produce
    from hsx_cli.main import main

    shared = {f.name for f in inspect.FLAGS} & {f.name for f in produce.FLAGS}
    assert shared == {"--dataset", "--mixture", "--model", "--layers", "--token-budget", "--max-batch-rows", "--pad-multiple",
                      "--dtype", "--store-dtype", "--codec", "--compute-dtype", "--fp8-accumulation", "--template-kwargs",
                      "--columns", "--max-length",
                      "--overlong", "--max-reject-share", "--tokenise-workers", "--window-rows", "--per-turn",
                      "--prefix-reuse", "--prefix-min-tokens", "--prefix-forward-tokens", "--prefix-stored-budgets",
                      "--prefix-rows"}
    by_name = {f.name: f for f in produce.FLAGS}
    assert all(f is by_name[f.name] for f in inspect.FLAGS if f.name in shared)   # one declaration, not a copy
    # Before, inspect declared --token-budget and --pad-multiple without produce's upper limits.
    common = ["--dataset", str(sample_dataset()), "--model", "m"]
    for flag, value in (("--token-budget", str(2**22 + 1)), ("--pad-multiple", "5000")):
        answers = []
        for argv in (["inspect", *common], ["produce", *common, "--run", "x", "--store", "/tmp/s"]):
            assert main([*argv, flag, value]) == 2
            answers.append(capsys.readouterr().err.strip().split(": error: ", 1)[1])
        assert answers[0] == answers[1] and flag in answers[0], answers


def test_inspect_runs_produces_identify_step_and_refuses_a_budget_no_worker_can_pin_alike(tiny_model, tmp_path, capsys,
                                                                                          redis_server):
    """One identify step (hsx.runspec.identify: layers, the store dtype, the pinned-memory bound) for produce and
    inspect: a token budget whose pinned buffers no GPU worker could hold is refused by both in the same line, and
    by inspect before it tokenises a row (it printed a plan before)."""
    import shutil

    from hsx_cli.main import main

    wide = tmp_path / "wide"   # the tiny model's config and tokenizer with a 32B-class width; no weights are read
    shutil.copytree(tiny_model, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 8192}))
    common = ["--dataset", str(sample_dataset()), "--model", str(wide), "--layers", "dflash:3", "--dtype", "float32",
              "--token-budget", str(2**21)]
    answers = []
    for argv in (["inspect", *common, "--tokenise-workers", "1"],
                 ["produce", *common, "--run", "pin", "--store", str(tmp_path / "store"), "--redis-url", redis_server.url]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert "rows:" not in out and "plan:" not in out
        answers.append(err.strip().split(": error: ", 1)[1])
    assert answers[0] == answers[1] and answers[0].startswith(f"--token-budget {2**21} needs 576 GiB of pinned host memory")
    # a budget that fits (9 GiB) times batches of trees storing 8 budgets (72 GiB) does not; with reuse off it does
    common[-1] = str(2**15)
    assert main(["inspect", *common, "--tokenise-workers", "1", "--prefix-stored-budgets", "8"]) == 2
    assert capsys.readouterr().err.strip().split(": error: ", 1)[1].startswith(
        f"--token-budget {2**15} x --prefix-stored-budgets 8 needs 72 GiB of pinned host memory")
    assert main(["inspect", *common, "--tokenise-workers", "1", "--prefix-stored-budgets", "8", "--prefix-reuse",
                 "off", "--samples", "0"]) == 0
