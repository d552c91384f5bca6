"""The page's first view, rendered on the server: the HTML as served already shows the run.

``first_view`` reads what /api/status serves (``dashboard.overview``: the same ``pick_run`` and
``build_overview``), so fields others add there reach the page by the template. The formatting filters
below are dashboard.js's own (same units, same words), so the page does not change its look when the
script takes over. Every value goes through Jinja's autoescaping (index.html never marks one safe):
Redis-sourced strings (run names, errors, worker names) are text, never markup. Secrets never reach the
page: the Redis URL is shown redacted, the access token and password are not in what is rendered.
"""

from __future__ import annotations

import time

from flask import Flask
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dashboard import state
from dashboard.outage import current_outage
from dashboard.overview import build_overview, pick_run
from hsx.redisconn import redact

# The progress bars, in dashboard.js's order: (key in overview["progress"], label).
BARS = (("samples", "samples"), ("tokens", "tokens"), ("batches_extracted", "batches extracted"),
        ("batches_uploaded", "batches uploaded + verified"))


def fmt_int(n) -> str:
    return f"{int(n or 0):,}"


def fmt_num(n, digits: int = 1) -> str:
    return "-" if n is None else f"{float(n):,.{digits}f}"


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    units, i, n = ("B", "KB", "MB", "GB", "TB", "PB"), 0, float(n)
    while abs(n) >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.1f} {units[i]}" if i else f"{n:.0f} {units[i]}"


def fmt_duration(seconds) -> str:
    if seconds is None:
        return "unknown"
    s = round(seconds)
    h, m, sec = s // 3600, (s % 3600) // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def fmt_clock(ts) -> str:
    """A failure's time (UTC; the script shows the browser's local time)."""
    return "-" if not ts else time.strftime("%H:%M:%S UTC", time.gmtime(ts))


def pct(done, total) -> float:
    return min(100.0, 100.0 * done / total) if total else 0.0


def badge(o: dict | None) -> tuple[str, str]:
    """(text, css class) of the run's state badge, as dashboard.js words it."""
    if o is None:
        return "no run yet", ""
    if o["complete"]:
        return "complete" + (", index written" if o["index_written"] else ""), "complete"
    lost = any(w["state"] == "lost" for w in o["workers"])
    return ("running, lost worker" if lost else "running") + (", plan unfinished" if o["planning"] else ""), \
        ("stalled" if lost else "running")


def problems(o: dict | None) -> list[str]:
    """Why the run needs a person (dashboard.js renderProblems)."""
    if o is None:
        return []
    lines = [o["planning"]["line"]] if o.get("planning") else []
    if o.get("stalled"):
        lines.append(f"STALLED: {o['stalled']}")
    if o.get("store_refusal"):
        lines.append(f"the store refuses uploads (batch {o['store_refusal'].get('batch')}): "
                     f"{o['store_refusal'].get('error')}")
    for host, rec in (o.get("upload_refused") or {}).items():
        lines.append(f"uploads refused on host {host} ({rec.get('jobs') or 0} jobs put back): "
                     f"{rec.get('message') or rec.get('cause')}")
    return lines


def first_view(requested: str | None) -> dict:
    """The template's context: ``run``, ``runs``, ``o`` (the overview /api/status serves, or None), ``error``
    (the Redis outage line, or a run Redis does not know), ``redis`` (redacted), ``rendered_at``."""
    st = state.current()
    view = {"run": requested or "", "runs": [], "o": None, "error": "", "redis": redact(st.config.redis_url),
            "rendered_at": time.strftime("%H:%M:%S UTC", time.gmtime()), "bars": BARS}
    try:
        run, view["runs"] = pick_run(st.redis, requested)
        if requested and run is None:
            view["error"] = f"no run {requested!r} in this Redis"
        elif run:
            view["o"] = build_overview(st.redis, run, st.config, st.plans)
            view["run"] = run
    except (RedisConnectionError, RedisTimeoutError) as exc:  # the page still loads; the script retries
        outage = current_outage()
        view["error"] = outage.message(outage.failed(exc), exc)
    view["badge"], view["badge_class"] = badge(view["o"])
    view["problems"] = problems(view["o"])
    return view


def install(app: Flask) -> None:
    for f in (fmt_int, fmt_num, fmt_bytes, fmt_duration, fmt_clock, pct):
        app.add_template_filter(f)
