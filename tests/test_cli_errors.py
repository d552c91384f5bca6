"""Errors a person can act on: each case's one-line message and exit code (2: expected, 1: a bug)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.redisconn import free_port
from hsx_cli.main import build_parser, main
from hsx_tools.demo import sample_dataset
from tests.manifests import example_manifest
from tests.waiting import scaled


def hsx(*args, env=None, seconds=120):
    return subprocess.run([sys.executable, "-m", "hsx_cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=scaled(seconds))


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"hsx {command}: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def test_unreachable_redis_fails_in_seconds_with_the_masked_url():
    port = free_port()  # nothing listens here
    out = hsx("status", env={"HSX_REDIS_URL": f"redis://:hunter2@127.0.0.1:{port}/0"}, seconds=60)
    assert out.returncode == 2, out.stderr
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in out.stderr
    assert "check that redis-server runs there, the host name and port, and HSX_REDIS_URL" in out.stderr
    assert "hunter2" not in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_missing_dataset_is_named_and_creates_no_store(tmp_path, capsys, redis_env):
    store = tmp_path / "store"
    code = main(["produce", "--dataset", str(tmp_path / "nope.jsonl"), "--model", "whatever", "--store", str(store)])
    assert code == 2
    assert one_error_line(capsys, "produce").endswith(f"dataset {tmp_path / 'nope.jsonl'} does not exist "
                                                      "(--dataset / HSX_DATASET)")
    assert not store.exists()


def test_model_path_that_does_not_exist_says_so(tmp_path, capsys, redis_env):
    code = main(["produce", "--dataset", str(sample_dataset()), "--model", str(tmp_path / "no-such-model"),
                 "--store", str(tmp_path / "store")])
    assert code == 2
    line = one_error_line(capsys, "produce")
    assert f"model path {tmp_path / 'no-such-model'} does not exist: give a local model folder" in line
    assert "Repo id" not in line


def test_unwritable_store_names_path_uid_and_fix_before_creating_anything(tmp_path, capsys, redis_env):
    store = Path("/proc/sys/hsx-store/out")  # a read-only filesystem for every user, root included
    code = main(["produce", "--dataset", str(sample_dataset()), "--model", "whatever", "--store", str(store)])
    assert code == 2
    line = one_error_line(capsys, "produce")
    uid = os.getuid()
    assert f"store {store} cannot be created: /proc/sys is not writable by uid {uid}" in line
    assert f"`install -d -o {uid} {store}`" in line and "--store / HSX_STORE" in line


def test_too_many_layers_for_the_model_suggests_dflash_n(tiny_model, tmp_path, capsys, redis_env):
    # README's real-run example (`--layers dflash`) against the demo's 6-layer model.
    code = main(["produce", "--dataset", str(sample_dataset()), "--model", str(tiny_model), "--layers", "dflash",
                 "--store", str(tmp_path / "store"), "--run", "layers"])
    assert code == 2
    line = one_error_line(capsys, "produce")
    assert "this model has only 6 decoder layers" in line and "use --layers dflash:3" in line
    assert not (tmp_path / "store").exists()


def test_gpu_on_cpu_only_torch_suggests_device_cpu(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this torch has a GPU")
    monkeypatch.setenv("HSX_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")  # never reached: the device is checked first
    code = main(["worker", "--run", "r", "--gpu", "0", "--spool-dir", "/tmp/hsx-never-made"])
    assert code == 2
    line = one_error_line(capsys, "worker")
    assert "cuda:0 asked (--gpu / --device), but this torch is built without CUDA" in line or "sees no CUDA GPU" in line
    assert "use --device cpu" in line


@pytest.mark.parametrize("argv,message", [
    (["produce", "--max-length", "-5"], "--max-length -5: must be at least 1"),
    (["produce", "--batches-per-shard", "0"], "--batches-per-shard 0: must be at least 1"),
    (["produce", "--batches-per-shard", "-1"], "--batches-per-shard -1: must be at least 1"),
    (["produce", "--token-budget", "10000000000"], "--token-budget 10000000000: must be at most 4194304"),
    (["produce", "--lease-seconds", "0"], "--lease-seconds 0: must be at least 2"),
    (["produce", "--max-attempts", "0"], "--max-attempts 0: must be at least 1"),
    (["worker", "--device", "cpu", "--spool-budget-gb", "0"], "--spool-budget-gb 0.0: must be greater than 0"),
    (["worker", "--device", "cpu", "--heartbeat-seconds", "0"], "--heartbeat-seconds 0.0: must be greater than 0"),
    (["upload", "--heartbeat-seconds", "-1"], "--heartbeat-seconds -1.0: must be greater than 0"),
    (["export", "--format", "specforge", "--out", "o", "--limit", "-1"], "--limit -1: must be at least 1"),
    (["dashboard", "--port", "70000"], "--port 70000: must be at most 65535"),
])
def test_numeric_flags_are_ranged(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("HSX_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    if argv[0] == "produce":
        argv = [*argv, "--dataset", "d.jsonl", "--model", "m", "--store", "/tmp/hsx-never-made"]
    assert main(argv) == 2
    assert one_error_line(capsys, argv[0]).endswith(message)


def test_retry_failed_refuses_ids_not_in_the_plan_and_creates_nothing(r, capsys, redis_env):
    from hsx.life import ledger, queues
    from hsx.life.ledger import BatchSpec

    specs = [BatchSpec(batch_id=f"b{i:07d}", index=i, shard="00000", samples=1, tokens=8, padded=8, padded_len=8,
                       sample_ids=[str(i)]) for i in range(3)]
    ledger.save_plan(r, "rf", example_manifest("rf"), specs, {"batches": 3, "samples": 3, "tokens": 24})
    ledger.record_failure(r, "rf", "b0000001", "boom", max_attempts=1)
    assert main(["retry-failed", "--run", "rf", "--batch", "b9999999", "--batch", "nonsense"]) == 2
    assert one_error_line(capsys, "retry-failed").endswith(
        "not in the plan of run 'rf': b9999999, nonsense; nothing was retried")
    assert main(["retry-failed", "--run", "rf", "--batch", "b0000002"]) == 2
    assert "not dead letters of run 'rf': b0000002" in one_error_line(capsys, "retry-failed")
    assert list(ledger.dead_letters(r, "rf")) == ["b0000001"]
    assert len(queues.queue(r, queues.extract_queue_name("rf"))) == 0
    assert main(["retry-failed", "--run", "rf", "--batch", "b0000001"]) == 0
    assert "re-enqueued 1 dead-letter batches" in capsys.readouterr().out
    assert not ledger.dead_letters(r, "rf") and len(queues.queue(r, queues.extract_queue_name("rf"))) == 1


def test_unexpected_error_exits_1_with_traceback_only_when_asked(monkeypatch, capsys):
    from hsx_cli import main as cli
    from hsx_cli.command import Command

    def boom(cfg):
        raise TypeError("a bug")

    monkeypatch.setattr(cli, "COMMANDS", (Command("boom", "raises", "raises a bug", (), lambda v: None, boom),))
    assert cli.main(["boom"]) == 1
    err = capsys.readouterr().err
    assert "hsx boom: unexpected error: TypeError: a bug (run with -v or HSX_DEBUG=1 for the traceback)" in err
    assert "Traceback" not in err
    assert cli.main(["-v", "boom"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "hsx boom: unexpected error: TypeError: a bug" in err
    monkeypatch.setenv("HSX_DEBUG", "1")
    assert cli.main(["boom"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_every_subcommand_has_a_description():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        assert parser.description and len(parser.description) > 40, name


def test_hub_retry_lines_are_logged_once():
    code = ("from hsx_cli.main import _quiet_libraries; _quiet_libraries(False); import logging; "
            "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=scaled(120))
    assert out.stderr.count("Retrying in 1s [Retry 1/5].") == 1, out.stderr


@pytest.mark.parametrize("argv", [
    ["status", "--run", "nosuch"],
    ["status", "--run", "nosuch", "--json"],
    ["verify", "--run", "nosuch"],
    ["retry-failed", "--run", "nosuch"],
    ["export", "--run", "nosuch", "--for", "specforge-eagle3", "--out", "{tmp}"],
])
def test_an_unknown_run_is_exit_2_with_one_line_naming_it_in_every_command(argv, r, capsys, redis_env, tmp_path):
    """One rule (README, "Exit codes"): a --run this Redis does not hold is a setting hsx cannot use."""
    from hsx.life import ledger

    ledger.save_plan(r, "known", example_manifest("known"), [], {"batches": 0, "samples": 0, "tokens": 0})
    assert main([a.replace("{tmp}", str(tmp_path / "out")) for a in argv]) == 2
    line = one_error_line(capsys, argv[0])
    assert "'nosuch'" in line and "known" in line, line
