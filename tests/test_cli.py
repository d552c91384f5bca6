import json
import os
import subprocess
import sys

import pytest

from gpu_worker.devices import GpuProbe
from hsx.runspec.config import ConfigError
from hsx_cli.main import build_parser
from tests.waiting import scaled

COMMANDS = ["run", "produce", "inspect", "worker", "upload", "status", "retry-failed", "reset", "dashboard", "verify", "show", "export",
            "evaluate",
            "demo", "demo-assets"]


def hsx(*args, env=None, seconds=120):
    return subprocess.run([sys.executable, "-m", "hsx_cli.main", *args], capture_output=True, text=True, env=env,
                          timeout=scaled(seconds))


def test_every_subcommand_has_help():
    assert hsx("--help").returncode == 0
    for command in COMMANDS:
        out = hsx(command, "--help")
        assert out.returncode == 0, out.stderr
        assert "usage: hsx " + command in out.stdout


def test_parser_knows_every_subcommand():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)


def test_every_flag_shows_its_variable_in_help():
    """The README's promise: every flag of every sub-command has an HSX_* variable, named in --help."""
    import re

    from hsx_cli.main import COMMANDS as TABLE

    for command in TABLE:
        out = hsx(command.name, "--help", env={**os.environ, "COLUMNS": "200"})
        text = " ".join(out.stdout.split())
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text)) - {"--help"}
        declared = {flag.name for flag in command.flags if flag.name.startswith("-")}   # positionals: no dashes
        assert flags == declared, f"hsx {command.name}: --help shows {sorted(flags)}, declared {sorted(declared)}"
        for flag in command.flags:
            assert flag.env_name.startswith("HSX_")
            assert flag.env_name in text, f"hsx {command.name} {flag.name}: {flag.env_name} missing from --help"
    assert "HSX_DEBUG" in hsx("--help").stdout


def test_no_command_or_config_has_a_setting_for_tests_only():
    """Tests that need slow batches pace them on their side (tests/pacedworker.py): hsx has no test knob."""
    import dataclasses

    from hsx import runspec
    from hsx_cli.main import COMMANDS

    knobs = [f"hsx {c.name} {f.name}" for c in COMMANDS for f in c.flags
             if f.name.startswith("--test") or "tests only" in f.help]
    knobs += [f"{config.__name__}.{f.name}" for config in (runspec.WorkerConfig, runspec.UploadConfig, runspec.ProduceConfig)
              for f in dataclasses.fields(config) if f.name.startswith("test") or f.name == "min_batch_seconds"]
    assert knobs == []


def test_flag_falls_back_to_its_variable_and_checks_it(monkeypatch):
    from hsx_cli import produce, worker
    from hsx_cli.flags import resolve

    args = build_parser().parse_args(["worker", "--device", "cpu"])
    monkeypatch.setenv("HSX_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("HSX_SPOOL_BUDGET_GB", "2")
    monkeypatch.setenv("HSX_BURST", "yes")
    cfg = worker.COMMAND.config(resolve(worker.FLAGS, args))
    assert cfg.spool_budget_bytes == 2 * 2**30 and cfg.burst and cfg.device == "cpu"
    monkeypatch.setenv("HSX_SPOOL_BUDGET_GB", "0")
    with pytest.raises(ConfigError, match="HSX_SPOOL_BUDGET_GB 0.0: must be greater than 0"):
        resolve(worker.FLAGS, args)
    args = build_parser().parse_args(["produce", "--dataset", "d", "--model", "m", "--store", "s"])
    monkeypatch.setenv("HSX_TOKEN_BUDGET", "lots")
    with pytest.raises(ConfigError, match="HSX_TOKEN_BUDGET='lots'"):
        resolve(produce.FLAGS, args)


def test_password_in_redis_flag_is_refused(monkeypatch):
    out = hsx("status", "--redis-url", "redis://:hunter2@127.0.0.1:1/0")
    assert out.returncode == 2 and "must not carry a password" in out.stderr and "hunter2" not in out.stderr


def test_missing_redis_is_named(monkeypatch):
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("HSX_REDIS_URL", "REDIS_URL")}
    out = hsx("status", env=env)
    assert out.returncode == 2 and "no Redis: set HSX_REDIS_URL" in out.stderr


def test_no_gpu_is_reported_not_raised():
    stats = GpuProbe(0).stats()
    if stats["gpu"] is None:
        assert stats["note"].startswith("no GPU")
    else:  # on a GPU machine the probe reads real numbers
        assert stats["mem_total_bytes"] > 0


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path, redis_env):
    out = hsx("demo", "--store", str(tmp_path / "out"), "--workdir", str(tmp_path / "work"), seconds=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "done: 13/13 batches, 160 samples" in out.stdout
    assert "unexpected error" not in out.stdout + out.stderr, out.stderr[-3000:]  # issue 41 item 4: StopRequested
    manifest = json.loads((tmp_path / "out" / "demo" / "manifest.json").read_text())
    assert manifest["layer_ids"] == [1, 2, 3]
    status = hsx("status", "--run", "demo", "--json")
    assert json.loads(status.stdout)["complete"] is True
    logs = {p.name: p.read_text() for p in (tmp_path / "work" / "logs" / "demo").glob("*.log")}  # hsx_tools/launch.py
    assert set(logs) == {"produce.log", "worker-cpu.log", "upload-0.log", "upload-1.log"}, sorted(logs)
    assert not [name for name, text in logs.items() if "unexpected error" in text or "Traceback" in text], logs


def test_nvml_index_follows_cuda_visible_devices(monkeypatch):
    from gpu_worker.devices import nvml_handle

    class FakeNvml:  # stands in for the driver, which this machine does not have
        def nvmlDeviceGetHandleByIndex(self, i):
            return ("index", i)

        def nvmlDeviceGetHandleByUUID(self, u):
            return ("uuid", u)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert nvml_handle(FakeNvml(), 1, None) == ("index", 5)
    assert nvml_handle(FakeNvml(), 0, "1234-abcd") == ("uuid", "GPU-1234-abcd")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-xyz")
    assert nvml_handle(FakeNvml(), 0, None) == ("index", 0)
