"""A mixture run's sources (hsx.prep.mixture): rows, rejects, samples, tokens and batches planned and done, each.

Nothing is kept per sample or per batch for this: every window of a mixture holds one source's rows, and its
record (``Run.window_records``, one a window) names that source beside its batch range and counts; a source's
done batches, samples and tokens are counted under its name when a batch is recorded done (the plan entry names
its source), so reading them is O(sources). A run whose counts do not add up (batches recorded by an older hsx)
is counted from the ledger's done batches in each source's ranges instead. A run of one dataset has no sources: ``[]``.
"""

from __future__ import annotations

import bisect
import json

import redis

from hsx import life
from hsx.runspec import Manifest, ManifestError


def _index(bid: str) -> int | None:
    return int(bid[1:]) if bid[:1] == "b" and bid[1:].isdigit() else None


def _manifest(r: redis.Redis, run: str) -> Manifest | None:
    try:
        return life.Run(r, run).manifest()
    except (ManifestError, ValueError):   # named as malformed by run_progress; no sources here
        return None


def source_progress(r: redis.Redis, run: str, samples_of: dict[str, int] | None = None,
                    tokens_of: dict[str, int] | None = None) -> list[dict]:
    """One row a source, in the mixture's order: ``{source, dataset, rows, rejected, samples, tokens, computed_tokens,
    batches, done: {batches, samples, tokens}}`` (computed_tokens: what the GPU computes for its planned tokens,
    padding in and each shared prefix once) (planned so far while the plan is not whole). ``samples_of`` /
    ``tokens_of``: batch id -> its samples / tokens, when the caller holds the plan (else done batches' plan
    entries are read, only for sources partly done)."""
    manifest = _manifest(r, run)
    if manifest is None or not manifest.mixture:
        return []
    rows = {s["name"]: {"source": s["name"], "dataset": s["dataset"], "rows": 0, "rejected": 0, "samples": 0,
                        "tokens": 0, "computed_tokens": 0, "batches": 0,
                        "done": {"batches": 0, "samples": 0, "tokens": 0}}
            for s in manifest.mixture}
    ranges: dict[str, list[range]] = {name: [] for name in rows}
    for raw in life.Run(r, run).window_records().values():
        try:
            rec = json.loads(raw)
            row, report = rows[rec["source"]], rec["report"]
            first, batches = int(rec["first_batch"]), int(rec["batches"])
            counts = (int(report["rows"]), sum(int(n) for n in report["rejected"].values()), int(rec["samples"]),
                      int(rec["tokens"]), int(rec.get("computed_tokens") or rec["padded_tokens"]))
        except (ValueError, KeyError, TypeError, AttributeError):   # not a record hsx wrote: left out
            continue
        for key, n in zip(("rows", "rejected", "samples", "tokens", "computed_tokens"), counts, strict=True):
            row[key] += n
        row["batches"] += batches
        ranges[rec["source"]].append(range(first, first + batches))
    counted = _counted(r, run, rows)
    if counted is not None:   # every done batch counted under its source as it was recorded: O(sources)
        for name, done in counted.items():
            rows[name]["done"].update(done)
        return list(rows.values())
    _scan_done(r, run, rows, ranges, samples_of, tokens_of)
    return list(rows.values())


def _counted(r: redis.Redis, run: str, rows: dict[str, dict]) -> dict[str, dict] | None:
    """Each source's done batches, samples and tokens from the run's done counters (``src:<source>:b|s|t``, moved
    with the ledger's by the script that records a batch done or takes it out: hsx/life/ledger.py); None where
    they do not add up to the run's done batches (batches recorded by an hsx that kept no such counts, or a ledger
    rebuilt from the store): the caller counts from the ledger instead."""
    counters = life.Run(r, run).done_counters()
    done = {name: {"batches": counters.get(f"src:{name}:b", 0), "samples": counters.get(f"src:{name}:s", 0),
                   "tokens": counters.get(f"src:{name}:t", 0)} for name in rows}
    if sum(d["batches"] for d in done.values()) != counters.get("batches", 0):
        return None
    return done


def _scan_done(r: redis.Redis, run: str, rows: dict[str, dict], ranges: dict[str, list[range]],
               samples_of: dict[str, int] | None, tokens_of: dict[str, int] | None) -> None:
    """Each source's done counts from the done ledger (O(run)) and the plan entries of partly done sources."""
    spans = sorted((span.start, span.stop, name) for name, found in ranges.items() for span in found)
    starts = [start for start, _, _ in spans]
    done_by: dict[str, list[str]] = {name: [] for name in rows}
    ledger = life.Run(r, run)
    for bid in ledger.done_ids():
        i = _index(bid)
        at = bisect.bisect_right(starts, i) - 1 if i is not None else -1
        if at >= 0 and i < spans[at][1]:
            done_by[spans[at][2]].append(bid)
    for name, row in rows.items():
        mine = done_by[name]
        row["done"]["batches"] = len(mine)
        if len(mine) == row["batches"]:       # all done (or none planned): the planned counts
            row["done"].update(samples=row["samples"] if mine else 0, tokens=row["tokens"] if mine else 0)
        elif samples_of is not None and tokens_of is not None:
            row["done"].update(samples=sum(samples_of.get(b, 0) for b in mine),
                               tokens=sum(tokens_of.get(b, 0) for b in mine))
        elif mine:
            specs = ledger.specs(mine)
            row["done"].update(samples=sum(s.samples for s in specs), tokens=sum(s.tokens for s in specs))


def source_lines(sources: list[dict]) -> list[str]:
    """`hsx status`'s lines for a mixture's sources (none for one dataset)."""
    if not sources:
        return []

    def of(done: int, planned: int) -> str:
        return f"{done:,}/{planned:,}" + (f" ({100 * done / planned:.1f}%)" if planned else "")

    lines = ["  sources  (done/planned)"]
    for s in sources:
        lines.append(f"    {s['source']}: rows {s['rows']:,} read, {s['rejected']:,} rejected; batches "
                     f"{of(s['done']['batches'], s['batches'])}, samples {of(s['done']['samples'], s['samples'])}, "
                     f"tokens {of(s['done']['tokens'], s['tokens'])}; {s['computed_tokens']:,} tokens computed "
                     f"for them (padding in, shared prefixes once)")
    return lines


def with_source_lines(lines: list[str], sources: list[dict]) -> list[str]:
    """`hsx status`'s summary ``lines`` with a mixture's source lines after the run's totals (its tokens line)."""
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("  tokens ")), len(lines))
    return [*lines[:at], *source_lines(sources), *lines[at:]]
