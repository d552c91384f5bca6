"""`hsx run` and `hsx demo`: a whole run on this host in one command, each role a child process.

    hsx produce            plans and enqueues window by window      \\
    hsx worker, per device --wait-for-plan --exit-when-complete       > started together (hsx_tools.processes),
    hsx upload x N         the spool of this host to the store        /  each logging to LOGS/<name>.log
    -> one live line (hsx_tools.watch.status_line) until the ledger says the run is complete
    -> every child stopped, the index written where the last uploader did not, `hsx verify`'s check

Roles meet in Redis and files as always (docs/architecture.md, rule 1): nothing here imports one. A run already complete is
said to be so at once and verified, no child started (its manifest compared with what the command asks
first). The first SIGINT or SIGTERM stops the children with SIGTERM (a worker finishes or hands back the batch
in hand, an uploader finishes its upload; spool files wait for the next call), a second one kills them (their
leases bring the work back). A private Redis is the caller's, stopped after the children.

Exit status: 0 complete and verified; 1 verify found gaps, batches left only in dead letters, or a child
failed; 2 where a child exited 2 (a setting or service it cannot use: its log's last lines are printed);
128 + the signal's number when stopped.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from hsx import life
from hsx.errors import ConfigError
from hsx.monitor import fmt_bytes, run_progress, summary_lines
from hsx.printable import printable
from hsx.redisconn import connect
from hsx.store import check_store
from hsx_tools.processes import Children
from hsx_tools.verify import verify_run
from hsx_tools.watch import status_line

POLL_SECONDS = 1.0    # between reads of the run's progress


@dataclass(frozen=True)
class Launch:
    run: str
    produce: tuple[str, ...]                         # arguments of `hsx produce`
    workers: tuple[tuple[str, tuple[str, ...]], ...]  # (log name, arguments of `hsx worker`), one a device
    upload: tuple[str, ...]                          # arguments of `hsx upload`
    uploaders: int
    logs: Path                                       # LOGS/<child>.log
    verify: str = "quick"                            # quick: sizes (HEAD); full: every object read back
    stop_seconds: float = 160.0                      # a child's bound after SIGTERM, then SIGKILL
    same_plan: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # manifest field -> asked
    retry_failed: bool = False                       # dead letters back on the queue before starting
    every_s: float = 10.0                            # seconds between progress lines off a terminal


class Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGINT and SIGTERM, while in use: the first raises Stopped where the main thread is; one that comes while
    children are being stopped (``stopping``), or a second, kills them instead."""

    def __init__(self):
        self.children: Children | None = None
        self.received: int | None = None
        self.stopping = False

    def _handle(self, signum, frame) -> None:
        if self.received is None and not self.stopping:
            self.received = signum
            raise Stopped(signum)
        self.received = self.received or signum
        if self.children is not None:
            print("hsx: a second stop: killing the children now (their leases bring their work back)", file=sys.stderr,
                  flush=True)
            self.children.kill()

    def __enter__(self) -> Signals:
        self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.old.items():
            signal.signal(s, handler)


class LiveLine:
    """The run's line: redrawn in place on a terminal, printed every ``every_s`` seconds elsewhere."""

    def __init__(self, every_s: float, stream=None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s, self.last, self.drawn = every_s, float("-inf"), False

    def show(self, p: dict, force: bool = False) -> None:
        text = status_line(p)
        if self.tty:
            width = shutil.get_terminal_size().columns - 1
            self.stream.write("\r\x1b[2K" + text[:width])
            self.drawn = True
        elif force or time.monotonic() - self.last >= self.every_s:
            self.stream.write(text + "\n")
            self.last = time.monotonic()
        self.stream.flush()

    def end(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def say(text: str) -> None:
    print(text, flush=True)


def launch(spec: Launch, redis_url: str, env: dict, signals: Signals) -> int:
    """Run ``spec`` to the end (see the module's doc); ``env``: the children's, HSX_REDIS_URL in it."""
    try:
        return _launch(spec, redis_url, env, signals)
    except Stopped as stop:
        return _stopped(spec, signals, stop)


def _launch(spec: Launch, redis_url: str, env: dict, signals: Signals) -> int:
    r = connect(redis_url)
    run = life.Run(r, spec.run)
    if run.exists():
        if spec.retry_failed:
            say(f"re-enqueued {len(run.retry())} dead-letter batches of run {spec.run}")
        p = run_progress(r, spec.run)
        if p["complete"]:
            _check_same_plan(run, spec)
            say(f"run {spec.run} is already complete: {p['done']['batches']} batches, {p['done']['samples']:,} "
                f"samples, {fmt_bytes(p['done']['bytes'])}; nothing to extract, verifying")
            return _verify(run, spec)
    children = signals.children = Children(spec.logs, env)
    try:
        children.start("produce", "produce", *spec.produce)
        for name, args in spec.workers:
            children.start(name, "worker", *args)
        for i in range(spec.uploaders):
            children.start(f"upload-{i}", "upload", *spec.upload)
        say(f"started hsx produce, {len(spec.workers)} worker{'s' * (len(spec.workers) != 1)} and {spec.uploaders} "
            f"uploader{'s' * (spec.uploaders != 1)}; their logs: {spec.logs}/")
        rc = _follow(r, spec, children)
    except Stopped as stop:
        return _stopped(spec, signals, stop)
    finally:
        signals.stopping = True
        children.stop(spec.stop_seconds)
        signals.stopping = False
    return rc if rc else _verify(run, spec)


def _follow(r, spec: Launch, children: Children) -> int:
    """Show the run's line until it is complete (0), or a child failed, or only dead letters are left (1)."""
    line = LiveLine(spec.every_s)
    try:
        while True:
            p = run_progress(r, spec.run)
            if not any(w.get("alive") for w in p["workers"]):
                p["stalled"] = None   # not before a worker beats: ours are loading the model (or have exited: below)
            if p["complete"]:
                line.show(p, force=True)
                return 0
            failed = {name: rc for name, rc in children.exited().items() if not (name == "produce" and rc == 0)}
            if failed:
                p = run_progress(r, spec.run)   # a worker exits 0 once the run is complete: that is no failure
                if p["complete"]:
                    line.show(p, force=True)
                    return 0
                line.end()
                name, rc = sorted(failed.items())[0]
                print(printable(f"hsx run: {name} exited with status {rc} before the run was complete; the end of "
                                f"{children.log_path(name)}:\n{children.tail(name)}", lines=True), file=sys.stderr)
                return 2 if rc == 2 else 1
            if _only_dead_letters(p):
                line.end()
                print("\n".join(printable(x) for x in summary_lines(p)), file=sys.stderr)
                print(f"hsx run: {len(p['dead_letters'])} batches failed for good (their errors above); run this "
                      "command again with --retry-failed once their cause is fixed", file=sys.stderr)
                return 1
            line.show(p)
            time.sleep(POLL_SECONDS)
    finally:
        line.end()


def _only_dead_letters(p: dict) -> bool:
    left = p["totals"].get("batches", 0) - p["done"]["batches"]
    return not p["planning"] and left > 0 and not p["extract_queue"] and len(p["dead_letters"]) >= left


def _stopped(spec: Launch, signals: Signals, stop: Stopped) -> int:
    signals.stopping = True
    if signals.children is not None:
        say(f"\nhsx run: {stop}: stopping the children (a worker finishes or hands back its batch, within "
            f"{spec.stop_seconds:.0f} s; a second Ctrl-C kills them)")
        signals.children.stop(spec.stop_seconds)
    say("hsx run: stopped; nothing done is lost: run the same command again to resume")
    return 128 + stop.signum


def _check_same_plan(run: life.Run, spec: Launch) -> None:
    manifest = run.require_manifest()
    differ = [f"{name} {getattr(manifest, name, None)} (this command: {asked})" for name, asked in spec.same_plan.items()
              if str(getattr(manifest, name, None)) != str(asked)]
    if differ:
        raise ConfigError(f"run {spec.run} is complete, planned with " + "; ".join(differ) + ": another plan is "
                          f"another run (--run NAME), or start this one over (hsx reset --run {spec.run})")


def _verify(run: life.Run, spec: Launch, out: Callable[[str], None] = say) -> int:
    """`hsx verify`'s check of the run (sizes with ``quick``), after writing the index if nobody has."""
    settings = run.require_manifest().store
    check_store(settings, "verify", run=spec.run)
    store = settings.open()
    run.write_index_if_complete(store)
    tidy = getattr(store, "remove_temp_files", None)   # a local store: puts of this host's killed processes
    removed = tidy(spec.run) if tidy else []         # (a second Ctrl-C, an OOM kill) left these
    if removed:
        out(printable(f"removed {len(removed)} temp files that killed writers of this host left in the store, e.g. "
                      f"{removed[0]}"))
    report = verify_run(run.r, store, spec.run, quick=spec.verify == "quick")
    for text in report.lines():
        out(printable(text))
    if report.ok:
        out(printable(f"run {spec.run} is complete and verified ({spec.verify}): {settings.url.rstrip('/')}/{spec.run}"))
    return 0 if report.ok else 1
