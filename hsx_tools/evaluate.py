"""`hsx evaluate`: a drafter's acceptance length and speedup against its target, measured by decoding.

hsx picks the prompts (a dataset file `hsx produce` reads, tokenised as produce tokenises it; or the held-out
samples of a run) and the stop tokens, then runs ``python -m hsx_peers.evaluate`` (peers/hsx_peers/evaluate.py:
SpecForge 0.2.0's own ``DFlashDraftModel.spec_generate`` against transformers' greedy ``generate``) in the
Python that has SpecForge: ``--peer-python``, else the SpecForge venv of scripts/peers.sh (``.peers/specforge``)
when there is one, else this Python. A sample's prompt is its tokens before its first supervised token
(for a chat row: the conversation up to the first assistant turn, with the assistant's header), so the
drafter continues where the run taught it to.

With ``--run``, the run's last ``--held-out`` samples also give the teacher-forced figure (no generation,
the stored hidden states), and the report is kept with the run: ``<run>/evaluation.json`` in its store and a
summary in Redis for `hsx status` (hsx/monitor/evaluation.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from hsx.errors import ConfigError
from hsx.store import StoreSettings

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class EvaluateConfig:
    model: Path
    drafter: Path
    draft_config: Path | None
    dataset: Path | None
    skip: int
    limit: int
    run: str | None
    store: StoreSettings | None
    held_out: int
    anchors: int
    max_new_tokens: int
    device: str
    dtype: str
    json: bool
    peer_python: str | None
    redis_url: str | None


class EvaluateError(ConfigError):
    """The evaluation cannot run as asked; the message says what to change."""


def check(cfg: EvaluateConfig) -> None:
    if not (cfg.model / "config.json").is_file():
        raise EvaluateError(f"--model {cfg.model}: no config.json there (want the target model's folder)")
    if not cfg.drafter.exists():
        raise EvaluateError(f"--drafter {cfg.drafter} does not exist (want a `specforge train` checkpoint folder, "
                            "or a draft config .json for an untrained drafter)")
    if cfg.draft_config is not None and not cfg.draft_config.is_file():
        raise EvaluateError(f"--draft-config {cfg.draft_config} does not exist")
    if cfg.dataset is None and cfg.run is None:
        raise EvaluateError("say where the prompts come from: --dataset FILE (any file hsx produce reads) or "
                            "--run R (its held-out samples)")
    if cfg.dataset is not None and not cfg.dataset.exists():
        raise EvaluateError(f"--dataset {cfg.dataset} does not exist")
    if cfg.run is not None and cfg.store is None:
        raise EvaluateError(f"--run {cfg.run}: pass --store (the run's store), or set HSX_REDIS_URL so hsx can read "
                            "the store the run recorded")


def prompts_from_dataset(model: Path, dataset: Path, skip: int, limit: int) -> list[list[int]]:
    """The first ``limit`` usable rows after ``skip``: each row's tokens before its first supervised token."""
    from transformers import AutoTokenizer

    from hsx.prep import ChatTokeniser, RowError, RowRejected, iter_rows

    tokeniser = ChatTokeniser(AutoTokenizer.from_pretrained(str(model)))
    prompts = []
    for row in iter_rows(dataset):
        if isinstance(row, RowError) or row.index < skip:
            continue
        try:
            sample = tokeniser.encode_row(row.data, row.index)
        except RowRejected:
            continue
        first = int(sample.loss_mask.argmax())
        if sample.loss_mask[first] and first > 0:
            prompts.append(sample.input_ids[:first].tolist())
        if len(prompts) == limit:
            break
    if not prompts:
        raise EvaluateError(f"--dataset {dataset}: no row after the first {skip} has a prompt and an answer")
    return prompts


def held_out_samples(store: StoreSettings, run: str, held_out: int) -> tuple[list[int], list[list[int]]]:
    """The run's last ``held_out`` samples (index order) and their prompts."""
    from hsx_reader import RunDataset

    ds = RunDataset(store, run, fetch="range")
    indices = list(range(max(0, len(ds) - held_out), len(ds)))
    prompts = []
    for i in indices:
        sample = ds[i]
        mask = sample["loss_mask"]
        first = int(mask.argmax())
        if mask[first] and first > 0:
            prompts.append(sample["input_ids"][:first].tolist())
    return indices, prompts


def stop_tokens(model: Path) -> list[int]:
    from transformers import AutoConfig, AutoTokenizer

    ids = []
    for source in (AutoTokenizer.from_pretrained(str(model)).eos_token_id, AutoConfig.from_pretrained(str(model)).eos_token_id):
        for value in source if isinstance(source, list) else [source]:
            if value is not None and int(value) not in ids:
                ids.append(int(value))
    if not ids:
        raise EvaluateError(f"--model {model}: no end-of-sequence token in its tokenizer or config")
    return ids


def peer_python(given: str | None) -> str:
    if given:
        return given
    venv = ROOT / ".peers" / "specforge" / "bin" / "python"
    if venv.exists():
        return str(venv)
    import importlib.util

    if importlib.util.find_spec("specforge") is not None:
        return sys.executable
    raise EvaluateError("no Python with SpecForge 0.2.0: run scripts/peers.sh, or pass --peer-python (a Python where "
                        "`pip install specforge==0.2.0 ./peers` was done)")


class Bar:
    """Progress on stderr: a bar redrawn in place on a terminal, else a line every 10 %."""

    def __init__(self, quiet: bool):
        self.quiet, self.tty, self.shown, self.started = quiet, sys.stderr.isatty(), -1, time.monotonic()

    def update(self, done: int, total: int) -> None:
        if self.quiet or not total:
            return
        elapsed = time.monotonic() - self.started
        text = f"evaluate {done}/{total} [{'#' * (30 * done // total):<30}] {elapsed:.0f}s"
        if self.tty:
            print("\r" + text, end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif 10 * done // total > self.shown:
            self.shown = 10 * done // total
            print(text, file=sys.stderr, flush=True)


def run_peer(cfg: EvaluateConfig, request: dict, quiet: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="hsx-evaluate-") as work:
        path = Path(work) / "request.json"
        path.write_text(json.dumps(request))
        python = peer_python(cfg.peer_python)
        argv = [python, "-m", "hsx_peers.evaluate", "--target", str(cfg.model),
                "--drafter", str(cfg.drafter), "--request", str(path), "--device", cfg.device, "--dtype", cfg.dtype]
        if cfg.draft_config:
            argv += ["--draft-config", str(cfg.draft_config)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        paths = [str(p) for p in (ROOT, ROOT / "peers") if (p / ("hsx" if p == ROOT else "hsx_peers")).is_dir()]
        if os.path.realpath(python) == os.path.realpath(sys.executable) and os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])  # this very interpreter (SpecForge beside hsx): keep its path
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        # Every torch.load in the peer unpickles tensors and plain values only, whatever its call says (the drafter's
        # own load is weights_only=True already: hsx_peers.evaluate.load_training_state); docs/training.md.
        env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
        env["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        bar, tail = Bar(quiet), deque(maxlen=20)
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
            for line in proc.stderr:
                if line.startswith("progress "):
                    _, done, total = line.split()
                    bar.update(int(done), int(total))
                else:
                    tail.append(line.rstrip())
            out = proc.stdout.read()
        errors = [x for x in tail if x.startswith("error: ")]
        if proc.returncode != 0:
            if errors:
                raise EvaluateError(errors[-1][len("error: "):])
            raise RuntimeError(f"python -m hsx_peers.evaluate failed ({proc.returncode}): " + " | ".join(tail))
        return json.loads(out.strip().splitlines()[-1])


def evaluate(cfg: EvaluateConfig, quiet: bool = False) -> dict:
    check(cfg)
    indices: list[int] = []
    prompts = prompts_from_dataset(cfg.model, cfg.dataset, cfg.skip, cfg.limit) if cfg.dataset else []
    if cfg.run:
        indices, held_prompts = held_out_samples(cfg.store, cfg.run, cfg.held_out)
        prompts = prompts or held_prompts[:cfg.limit]
    request = {"prompts": prompts, "max_new_tokens": cfg.max_new_tokens, "stop_token_ids": stop_tokens(cfg.model)}
    if cfg.run:
        request["teacher_forced"] = {"store": cfg.store.url, "endpoint_url": cfg.store.endpoint_url, "run": cfg.run,
                                     "samples": indices, "anchors": cfg.anchors}
    started = time.monotonic()
    report = run_peer(cfg, request, quiet)
    report.update(ts=time.time(), seconds=time.monotonic() - started,
                  prompts_from=str(cfg.dataset) if cfg.dataset else f"run {cfg.run}, last {cfg.held_out} samples")
    return report


def keep_with_run(cfg: EvaluateConfig, report: dict) -> str:
    """Write ``<run>/evaluation.json`` into the run's store, and the summary to Redis when there is one."""
    from hsx import life, monitor
    from hsx.store import layout, open_store

    store = open_store(cfg.store.url, cfg.store.endpoint_url, cfg.store.region)
    store.put_bytes(layout.evaluation_key(cfg.run), json.dumps(report, indent=1).encode())
    if cfg.redis_url:
        from hsx.redisconn import connect

        life.Run(connect(cfg.redis_url), cfg.run).record_evaluation(monitor.evaluation_summary(report))
    return store.url(layout.evaluation_key(cfg.run))


def report_lines(report: dict) -> list[str]:
    d, info = report.get("decode"), report["drafter"]
    lines = [f"drafter {info['checkpoint']} ({'step ' + str(info['global_step']) if info['trained'] else 'untrained'}, "
             f"block {info['block_size']}, layers {info['target_layer_ids']}) on {report['device']} {report['dtype']}"]
    if d:
        dist = ", ".join(f"{k}: {v}" for k, v in d["tau_distribution"].items())
        lines += [
            f"prompts {d['prompts']} ({report['prompts_from']}), up to {d['max_new_tokens']} new tokens each",
            f"tau (accepted per target forward, bonus included) {d['tau']:.3f} over {d['verify_steps']} steps; "
            f"distribution {{{dist}}}",
            f"target forwards per generated token {d['target_forwards_per_token']:.3f} (target-only greedy: 1)",
            f"tokens/s speculative {d['speculative_tokens_per_second']:.1f}, target-only greedy "
            f"{d['target_only_tokens_per_second']:.1f}: speedup {d['speedup']:.2f}x",
            f"identical to target-only greedy: {d['identical_prompts']}/{d['prompts']} prompts; "
            f"{d['seconds_per_prompt']:.2f} s a prompt (both decodes)",
        ]
    t = report.get("teacher_forced")
    if t:
        lines.append(f"teacher-forced (run {t['run']}, {t['samples']} samples, {t['blocks']} blocks, no generation): "
                     f"accepted prefix {t['accepted_prefix_mean']:.3f} tokens a block (tau-equivalent "
                     f"{t['tau_equivalent']:.3f}), {t['seconds']:.1f} s")
    return lines
