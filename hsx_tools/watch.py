"""`hsx status --watch`: the dashboard's overview in the terminal, live (rich; ``watch_plain`` off a terminal);
``status_line``: the same run in one line (`hsx run`).

Redraws every ``interval`` seconds from ``hsx.monitor.progress.run_progress``: progress
bars (samples, tokens, batches extracted, batches uploaded and verified), rate
and ETA, one row a GPU worker, one row a host (spool against budget, upload
queue, uploaders), and the dead letters. Ends when the run is complete, after
``max_iterations`` redraws, or on Ctrl-C; returns the exit code (0, or 1 when
Redis cannot be reached).
"""

from __future__ import annotations

import time

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

from hsx.monitor import fmt_bytes, fmt_duration, host_row, run_progress, source_lines, source_progress, summary_lines, with_source_lines
from hsx.printable import printable

BARS = (("samples", "samples"), ("tokens", "tokens"), ("extracted", "batches extracted"),
        ("uploaded", "batches uploaded + verified"))


def _bar_values(p: dict) -> dict[str, tuple[int, int]]:
    t, d = p["totals"], p["done"]
    return {"samples": (d["samples"], t.get("samples", 0)), "tokens": (d["tokens"], t.get("tokens", 0)),
            "extracted": (p["spooled_batches"], t.get("batches", 0)), "uploaded": (d["batches"], t.get("batches", 0))}


def _header(p: dict) -> Text:
    state = "COMPLETE" if p["complete"] else "in progress"
    rate = p["rate"]
    return Text(f"run {printable(p['run'])}: {state}   {rate['samples']:.1f} samples/s, {rate['tokens']:.0f} tokens/s "
                f"(last {fmt_duration(p['rate_span_seconds'])})   ETA {fmt_duration(p['eta_seconds'])}   "
                f"extract queue {p['extract_queue']}   uploaded {fmt_bytes(p['done']['bytes'])}", style="bold")


def _workers_table(p: dict) -> Table:
    table = Table(title="GPU workers", title_justify="left", expand=False)
    for col in ("worker", "host", "gpu", "util", "memory", "temp", "power", "batch", "heartbeat", "batches", "state"):
        table.add_column(col)
    for w in p["workers"]:
        mem = (f"{fmt_bytes(w['mem_used_bytes'])}/{fmt_bytes(w['mem_total_bytes'])}"
               if w.get("mem_total_bytes") is not None else "-")
        state = w["state"] if w["state"] != "alive" else f"alive, {'busy' if w.get('current_batch') else 'idle'}"
        table.add_row(printable(w["worker"]), printable(w.get("host") or "-"),   # Redis' records: shown, never obeyed
                      printable(w.get("name") or w.get("device") or "-"),
                      "-" if w.get("util_pct") is None else f"{w['util_pct']}%", mem,
                      "-" if w.get("temp_c") is None else f"{w['temp_c']} C",
                      "-" if w.get("power_w") is None else f"{w['power_w']:.0f} W",
                      printable(w.get("current_batch") or "-"), f"{w['age_seconds']:.0f}s ago", str(w.get("batches", 0)),
                      Text(state, style="red" if state == "lost" else ""))
    return table


def _hosts_table(r: redis.Redis, p: dict) -> Table:
    table = Table(title="hosts", title_justify="left", expand=False)
    for col in ("host", "spool", "files", "upload queue", "uploaders"):
        table.add_column(col)
    for host, stats in sorted(p["hosts"].items()):
        row = host_row(r, host, stats)
        table.add_row(printable(host), f"{fmt_bytes(row['spool_bytes'])} / {fmt_bytes(row['spool_budget_bytes'])}",
                      str(row["spool_files"]), str(row["upload_queue"]), str(row["uploaders"]))
    return table


def _failures(p: dict) -> Text:
    lines = [f"{len(p['dead_letters'])} dead letters, {len(p['failures'])} retrying"]
    for bid, rec in sorted(p["dead_letters"].items())[:10]:
        lines.append(printable(f"  {bid}: {rec['attempts']} attempts: {rec['last_error'][:160]}"))
    return Text("\n".join(lines), style="red" if p["dead_letters"] else "")


def status_line(p: dict) -> str:
    """The run in one line (`hsx run`'s live view): batches, samples, ETA, rate, failures, workers, a stall (what a
    narrow terminal cuts off last first)."""
    t, d = p["totals"], p["done"]
    samples = t.get("samples", 0)
    alive = sum(1 for w in p["workers"] if w.get("alive"))
    if not t.get("batches"):
        line = f"run {p['run']}: planning (no batch planned yet), workers alive: {alive}"
    else:
        line = (f"run {p['run']}: {d['batches']}/{t['batches']} batches, {d['samples']:,}/{samples:,} samples"
                + (f" ({100 * d['samples'] / samples:.0f}%)" if samples else "")
                + (" of the plan so far" if p.get("planning") else "")
                + f", ETA {fmt_duration(p['eta_seconds'])}, {p['rate']['tokens']:,.0f} tok/s, "
                f"failed: {len(p['dead_letters'])}, retrying: {len(p['failures'])}, workers alive: {alive}")
    if p.get("stalled"):
        line += f"; STALLED: {p['stalled']}"
    return printable(line)   # Redis' records: shown, never obeyed


def _poll(r: redis.Redis, run: str, interval: float, max_iterations: int | None, show, say) -> int:
    """Call ``show(progress)`` every ``interval`` s until the run is complete or ``max_iterations`` ran.

    Exit status: 0 when done or interrupted, 1 when Redis is unreachable (told through ``say``)."""
    iterations = 0
    try:
        while True:
            p = run_progress(r, run)
            show(p)
            iterations += 1
            if p["complete"] or (max_iterations is not None and iterations >= max_iterations):
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    except redis.exceptions.ConnectionError as exc:
        say(f"hsx status --watch: Redis unreachable: {exc}")
        return 1


def watch(r: redis.Redis, run: str, interval: float = 2.0, max_iterations: int | None = None,
          console: Console | None = None) -> int:
    console = console or Console()
    bars = Progress(TextColumn("{task.description:>28}"), BarColumn(bar_width=None), MofNCompleteColumn(),
                    TaskProgressColumn(), console=console, expand=True)
    tasks = {key: bars.add_task(label, total=None) for key, label in BARS}
    with Live(console=console, refresh_per_second=4, transient=False, auto_refresh=False) as live:
        def show(p: dict) -> None:
            for key, (done, total) in _bar_values(p).items():
                bars.update(tasks[key], completed=done, total=total or None)
            sources = source_lines(source_progress(r, run))   # a mixture's; none for one dataset
            live.update(Group(_header(p), bars, *([Text("\n".join(sources))] if sources else []), _workers_table(p),
                              _hosts_table(r, p), _failures(p)), refresh=True)

        return _poll(r, run, interval, max_iterations, show, console.print)


def watch_plain(r: redis.Redis, run: str, interval: float = 2.0, max_iterations: int | None = None) -> int:
    """``watch`` for a log file or a pipe: the status summary every ``interval`` seconds, no terminal codes."""
    return _poll(r, run, interval, max_iterations,
                 lambda p: print("\n".join(printable(x) for x in with_source_lines(summary_lines(p),
                                                                                   source_progress(r, run))), flush=True),
                 lambda msg: print(printable(msg), flush=True))
