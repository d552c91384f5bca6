"""Progress of one long step (verify's objects, export's samples, produce's rows): a bar on a terminal,
a line in the log every ``every_s`` seconds otherwise.

    progress = Progress("verify run r", total=400, unit="batches")
    for ... :
        progress.advance()          # or advance(n)
    progress.close()                # the bar's last state, or a final log line

On a terminal (``stream.isatty()``) the bar is redrawn in place at most every REDRAW_S seconds:
``verify run r  [########------------]  160/400 batches  40%  12.1/s  ETA 20s``. Elsewhere (a log file,
a container's output) one INFO line every ``every_s`` seconds through ``log``, the same figures without the
bar. ``total`` None: counts and rate only. Writes nothing else; never raises on a closed stream.
"""

from __future__ import annotations

import logging
import sys
import time

DEFAULT_EVERY_S = 10.0    # seconds between log lines (not a terminal)
REDRAW_S = 0.2            # seconds between redraws of the bar (a terminal)
BAR_WIDTH = 24            # characters of the bar

log = logging.getLogger("hsx.progress")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    def __init__(self, what: str, total: int | None = None, unit: str = "items", stream=None,
                 every_s: float | None = None, logger: logging.Logger | None = None, clock=time.monotonic):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = DEFAULT_EVERY_S if every_s is None else every_s    # read now: settable for a whole process
        self.log, self.clock = logger or log, clock
        self.done = 0
        self.started = self.last = clock()
        self.closed = False

    def text(self) -> str:
        """The figures: ``160/400 batches  40%  12.1/s  ETA 20s`` (no bar)."""
        elapsed = max(self.clock() - self.started, 1e-9)
        rate = self.done / elapsed
        if self.total:
            share = min(self.done / self.total, 1.0)
            eta = f"  ETA {_duration((self.total - self.done) / rate)}" if rate > 0 and self.done < self.total else ""
            return f"{self.done:,}/{self.total:,} {self.unit}  {share:.0%}  {rate:,.1f}/s{eta}"
        return f"{self.done:,} {self.unit}  {rate:,.1f}/s"

    def line(self) -> str:
        if self.tty and self.total:
            filled = int(BAR_WIDTH * min(self.done / self.total, 1.0))
            return f"{self.what}  [{'#' * filled}{'-' * (BAR_WIDTH - filled)}]  {self.text()}"
        return f"{self.what}: {self.text()}"

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= (REDRAW_S if self.tty else self.every_s):
            self.last = now
            self._emit()

    def _emit(self) -> None:
        if self.tty:
            try:
                self.stream.write("\r\x1b[2K" + self.line())
                self.stream.flush()
            except (OSError, ValueError):
                self.tty = False
        else:
            self.log.info("%s", self.line())

    def close(self) -> None:
        """The final state: the bar drawn full and its line ended, or one last log line."""
        if self.closed:
            return
        self.closed = True
        self._emit()
        if self.tty:
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
