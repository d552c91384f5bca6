"""Terminal escapes from data (issue 37 item 6): a row's text, a sample id, a rejected row's message or a record in
Redis reaches the operator's terminal shown, never obeyed: `hsx show`, `hsx inspect` (piped and on a terminal),
`hsx status`, a rejected row's message, log lines. On main a row set the window title (OSC 0), wrote the clipboard
(OSC 52) and cleared the screen (CSI 2J)."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from hsx.printable import PrintableFormatter, printable
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from tests.pipeline import run_pipeline
from tests.waiting import scaled

RUN = "escrun"
TITLE, CLIPBOARD, CLEAR = "\x1b]0;pwned-title\x07", "\x1b]52;c;cHduZWQ=\x07", "\x1b[2J"
C1_CSI, BIDI = "\u009b31m", "\u202eevil\u202c"
EVIL = f"{TITLE}{CLIPBOARD}{CLEAR}{C1_CSI}{BIDI}\rover\x08"
# Any character a terminal acts on; newline and tab are allowed where the output is text.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
SGR = re.compile("\x1b\\[[0-9;]*m")   # rich's own colours on a terminal: hsx's, not the data's


def _obeyed(text: str, terminal: bool = False) -> list[str]:
    """The control characters ``text`` would send to a terminal (rich's colour codes aside when ``terminal``)."""
    return CONTROL.findall(SGR.sub("", text) if terminal else text)


def test_printable_shows_every_control_and_keeps_the_text():
    shown = printable(EVIL)
    assert _obeyed(shown) == [] and printable(shown) == shown   # once is enough
    assert shown == ("\\x1b]0;pwned-title\\x07\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x9b31m\\u202eevil\\u202c\\rover\\b")
    assert printable("a\tb\nc") == "a\tb\\nc" and printable("a\tb\nc", lines=True) == "a\tb\nc"
    assert printable("héllo, 世界 🙂") == "héllo, 世界 🙂"


def test_log_lines_show_data_and_keep_a_tracebacks_lines():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("hsx.test-printable")
    log.addHandler(handler)
    try:
        log.warning("sample %s rejected: %s", EVIL, "line one\nforged line")
        try:
            raise ValueError(f"row text {EVIL}")
        except ValueError:
            log.exception("batch %s failed", EVIL)
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert _obeyed(text) == [], _obeyed(text)
    assert "WARNING hsx.test-printable: sample \\x1b]0;pwned-title" in text and "line one\\nforged line" in text
    assert "Traceback (most recent call last):\n" in text and "ValueError: row text \\x1b]0;" in text
    # the hsx CLI's own logging (every role logs through it): a process as `hsx <command>` sets it up
    import subprocess
    import sys

    probe = ("import logging, sys; from hsx_cli.main import _quiet_libraries; _quiet_libraries(False); "
             "logging.getLogger('hsx.probe').warning('sample %s failed', sys.argv[1])")
    err = subprocess.run([sys.executable, "-c", probe, EVIL], capture_output=True, text=True, timeout=scaled(120)).stderr
    assert "WARNING hsx.probe: sample \\x1b]0;pwned-title\\x07" in err and _obeyed(err) == [], err


def _rows(path):
    good = [json.loads(x) for x in sample_dataset().read_text().splitlines()[:6]]
    for row in good[:3]:   # the escapes in the id, the user's text and the assistant's answer
        row["id"] = f"{row.get('id', 'r')}-{EVIL}"
        row["messages"] = [{"role": "user", "content": f"say {EVIL} please"},
                           {"role": "assistant", "content": f"here: {EVIL} done"}]
    rejected = {"id": f"bad-{EVIL}", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good, rejected]))
    return path


@pytest.fixture(scope="module")
def escaped_run(redis_server, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("printable")
    data = _rows(root / "d.jsonl")
    run_pipeline(redis_server.url, tiny_model, str(root / "store"), root / "spool", run=RUN, dataset=data,
                 max_reject_share=0.5)
    return root / "store", data


def test_show_prints_a_rows_text_and_id_shown_not_obeyed_piped_and_on_a_terminal(escaped_run, capsys, monkeypatch):
    store, _ = escaped_run
    assert main(["show", RUN, "--store", str(store)]) == 0
    listing = capsys.readouterr().out
    assert _obeyed(listing) == [] and "-\\x1b]0;pwned-title\\x07" in listing, listing
    evil_id = next(x for x in listing.split() if "pwned" in x)
    sample = "#" + re.search(r"#(\d+)\s+\S*pwned", listing).group(1)
    assert main(["show", RUN, sample, "--store", str(store)]) == 0
    piped = capsys.readouterr().out
    assert _obeyed(piped) == [], _obeyed(piped)
    assert evil_id in piped and "[[here: \\x1b]0;pwned-title\\x07\\x1b]52;c;" in piped and "\\x1b[2J" in piped
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(["show", RUN, sample, "--store", str(store)]) == 0
    tty = capsys.readouterr().out
    assert SGR.search(tty) and _obeyed(tty, terminal=True) == [], _obeyed(tty, terminal=True)
    assert "\\x1b]52;c;cHduZWQ=\\x07" in tty and "\\u202eevil\\u202c" in tty


def test_inspect_and_a_rejected_rows_message_show_data_not_obeyed(escaped_run, tiny_model, capsys, monkeypatch):
    _, data = escaped_run
    argv = ["inspect", "--dataset", str(data), "--model", str(tiny_model), "--layers", "dflash:3", "--samples", "7",
            "--tokenise-workers", "1"]
    assert main(argv) == 0
    piped = capsys.readouterr().out
    assert _obeyed(piped) == [], _obeyed(piped)
    assert "row 7 (id bad-\\x1b]0;pwned-title\\x07" in piped and "\\x9b31m\\u202eevil" in piped   # the rejected row
    assert "id " in piped and "[[here: \\x1b]0;pwned-title" in piped                              # a kept row's text
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert main(argv) == 0
    tty = capsys.readouterr().out
    assert SGR.search(tty) and _obeyed(tty, terminal=True) == [], _obeyed(tty, terminal=True)


def test_a_rejected_rows_message_in_produces_refusal_and_status_are_shown_not_obeyed(escaped_run, tiny_model,
                                                                                   redis_env, r, tmp_path, capsys):
    _, data = escaped_run
    rc = main(["produce", "--dataset", str(data), "--model", str(tiny_model), "--store", str(tmp_path / "store"),
               "--run", "refused", "--max-reject-share", "0", "--layers", "dflash:3"])
    err = capsys.readouterr().err
    assert rc == 2 and _obeyed(err) == [], (rc, _obeyed(err), err[-2000:])
    assert "(id bad-\\x1b]0;pwned-title\\x07\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x9b31m" in err, err
    from hsx.life import batchlife

    store = str(tmp_path / "store")
    assert main(["produce", "--dataset", str(data), "--model", str(tiny_model), "--store", store, "--run", "st",
                 "--max-reject-share", "0.5", "--layers", "dflash:3", "--no-enqueue"]) == 0
    batchlife.fail(r, "st", "b0000000", f"worker said: {EVIL}", max_attempts=1, requeue=False)   # a dead letter's error
    capsys.readouterr()
    assert main(["status", "--run", "st"]) == 0
    out = capsys.readouterr().out
    assert _obeyed(out) == [], _obeyed(out)
    assert "b0000000: 1 attempts, last error: worker said: \\x1b]0;pwned-title\\x07" in out, out
