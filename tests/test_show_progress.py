"""`hsx show` reads a stored sample back (issue 31, item 9) and long single steps report progress: a bar on a
terminal, a periodic log line otherwise, through one helper used by verify, export and produce (item 10)."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from hsx.monitor.progressline import Progress
from hsx_tools.demo import sample_dataset
from tests.pipeline import run_pipeline
from tests.waiting import scaled

RUN = "showrun"


@pytest.fixture(scope="module")
def small_run(redis_server, tiny_model, tmp_path_factory):
    """16 shipped conversations extracted in-process into a local store: (store folder, produce log lines)."""
    root = tmp_path_factory.mktemp("show")
    data = root / "d.jsonl"
    data.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:16]))
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    progress_log = logging.getLogger("hsx.progress")
    progress_log.addHandler(handler)
    level = progress_log.level
    progress_log.setLevel(logging.INFO)   # setLevel, not .level =: it clears the loggers' cached isEnabledFor
    import hsx.monitor.progressline as pl

    saved, pl.DEFAULT_EVERY_S = pl.DEFAULT_EVERY_S, 0.0      # a line for every step of produce's tokenising
    try:
        run_pipeline(redis_server.url, tiny_model, str(root / "store"), root / "spool", run=RUN, dataset=data)
    finally:
        pl.DEFAULT_EVERY_S = saved
        progress_log.removeHandler(handler)
        progress_log.setLevel(level)
    return root / "store", records


def hsx(*args, env=None):
    return subprocess.run([sys.executable, "-m", "hsx_cli.main", *args], capture_output=True, text=True, timeout=scaled(300),
                          env=env)


def test_show_prints_text_with_mask_shapes_layer_stats_and_bytes(small_run):
    store, _ = small_run
    out = hsx("show", RUN, "#0", "--store", str(store))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert re.search(r"sample \S+ of run showrun: #0, row \d+ of showrun/batches/\S+\.safetensors \(.+; size \+ "
                     r"SHA-256 checked against the index\)", text), text
    tokens = int(re.search(r"  (\d+) tokens, (\d+) in the loss mask", text).group(1))
    assert re.search(rf"  input_ids\s+\[{tokens}\]\s+int32", text)
    assert re.search(rf"  hidden_states\s+\[{tokens}, 192\]\s+float32", text)   # 3 layers x 64, float32 run
    stats = re.findall(r"^\s+(\d+)\s+(-?[\d.e+-]+)\s+([\d.e+-]+)\s+([\d.e+-]+)\s+(\d+)$", text, re.M)
    assert [s[0] for s in stats] == ["1", "2", "3"] and all(s[4] == "0" for s in stats)   # dflash:3 of 6, finite
    assert all(float(s[2]) > 0 and float(s[3]) > 0 for s in stats)
    assert "[[" in text and "]]" in text and "<|im_start|>" in text


def test_show_without_a_sample_lists_the_run_and_a_bad_sample_is_one_line_exit_2(small_run):
    store, _ = small_run
    listing = hsx("show", RUN, "--store", str(store))
    assert listing.returncode == 0, listing.stderr
    assert re.search(r"run showrun: 16 samples in \d+ batch objects", listing.stdout)
    assert "show one: hsx show showrun SAMPLE_ID" in listing.stdout
    bad = hsx("show", RUN, "no-such-sample", "--store", str(store))
    assert bad.returncode == 2 and "sample 'no-such-sample' is not in run 'showrun'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_show_notices_a_corrupt_object(small_run, tmp_path):
    import shutil

    store, _ = small_run
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    obj = sorted((copy / RUN / "batches").rglob("*.safetensors"))[0]
    raw = bytearray(obj.read_bytes())
    raw[-3] ^= 0xFF                                             # same size, one byte flipped in a tensor
    obj.write_bytes(bytes(raw))
    listing = hsx("show", RUN, "--store", str(copy))
    first = re.search(r"#(\d+)  (\S+)  \(" + re.escape(f"{RUN}/batches/{obj.parent.name}/{obj.name}"), listing.stdout)
    out = hsx("show", RUN, f"#{first.group(1)}", "--store", str(copy))
    assert out.returncode == 2 and "sha" in out.stderr.lower(), out.stderr


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_a_bar_on_a_terminal_and_logs_lines_elsewhere(caplog):
    ticks = iter(range(100))
    term = Terminal()
    with Progress("verify r", 4, "batches", stream=term, clock=lambda: float(next(ticks))) as bar:
        for _ in range(4):
            bar.advance()
    drawn = term.getvalue()
    assert drawn.count("\r") >= 4 and drawn.endswith("\n")
    assert "verify r  [##################------]  3/4 batches  75%" in drawn
    assert "[########################]  4/4 batches  100%" in drawn     # close() draws the final state
    caplog.set_level(logging.INFO, logger="hsx.progress")
    now = [0.0]
    with Progress("export r", 10, "samples", stream=io.StringIO(), every_s=10, clock=lambda: now[0]) as p:
        for _ in range(10):
            now[0] += 5                                          # a sample every 5 s
            p.advance()
    lines = [r.getMessage() for r in caplog.records if r.name == "hsx.progress"]
    assert lines and all(line.startswith("export r: ") and "[" not in line for line in lines)
    assert len(lines) == 6 and lines[-1].startswith("export r: 10/10 samples  100%")     # every 10 s + the last


def test_verify_export_and_produce_report_progress_through_the_helper(small_run, redis_server, caplog, tmp_path,
                                                                     monkeypatch):
    import hsx.monitor.progressline as pl
    from hsx.life import ledger
    from hsx.redisconn import connect
    from hsx.runspec.config import StoreSettings
    from hsx_tools.export import export_run
    from hsx_tools.verify import verify_run

    store, produce_lines = small_run
    assert any(re.match(r"tokenise d\.jsonl for run showrun: \d+ rows\s+[\d.,]+/s", m) for m in produce_lines), \
        produce_lines
    monkeypatch.setattr(pl, "DEFAULT_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="hsx.progress")
    r = connect(redis_server.url)
    report = verify_run(r, ledger.require_manifest(r, RUN).store.open(), RUN, progress_every_s=0)
    assert report.ok
    verify_lines = [m.getMessage() for m in caplog.records if m.getMessage().startswith(f"verify {RUN}: ")]
    assert len(verify_lines) == report.planned + 1 and f"{report.planned}/{report.planned} batches  100%" in verify_lines[-1]
    monkeypatch.setattr("hsx_tools.export.PROGRESS_SECONDS", 0.0)
    export_run(StoreSettings(url=str(store)), RUN, "specforge-dflash", tmp_path / "x")
    export_lines = [m.getMessage() for m in caplog.records if m.getMessage().startswith(f"export {RUN}: ")]
    assert export_lines and "16/16 samples  100%" in export_lines[-1]
