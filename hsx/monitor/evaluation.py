"""A run's evaluation: the last `hsx evaluate` of a drafter trained on the run (acceptance length, speedup).

`hsx evaluate --run R` writes the whole report beside the manifest as ``<run>/evaluation.json`` (in the
run's store) and a summary to Redis (``evaluation``, last writer wins), which ``hsx status`` prints. The
summary (JSON): ``{"drafter", "global_step", "tau", "target_forwards_per_token", "speedup", "identical_prompts",
"prompts", "teacher_forced_accepted_prefix", "device", "ts"}``; any field may be None where it was not measured.
"""

from __future__ import annotations

import json

from hsx.life import RunKeys, records

FIELDS = ("drafter", "global_step", "tau", "target_forwards_per_token", "speedup", "identical_prompts", "prompts",
          "teacher_forced_accepted_prefix", "device", "ts")
SHAPE = {f: (str, type(None)) if f in ("drafter", "device") else (*records.NUMBER, type(None)) for f in FIELDS}


def summary(report: dict) -> dict:
    """The Redis summary of an `hsx evaluate` report (hsx_tools.evaluate)."""
    decode, forced = report.get("decode") or {}, report.get("teacher_forced") or {}
    drafter = report.get("drafter") or {}
    return {"drafter": drafter.get("checkpoint"), "global_step": drafter.get("global_step"), "tau": decode.get("tau"),
            "target_forwards_per_token": decode.get("target_forwards_per_token"), "speedup": decode.get("speedup"),
            "identical_prompts": decode.get("identical_prompts"), "prompts": decode.get("prompts"),
            "teacher_forced_accepted_prefix": forced.get("accepted_prefix_mean"), "device": report.get("device"),
            "ts": report.get("ts")}


def record_evaluation(r, run: str, report: dict) -> dict:
    entry = summary(report)
    r.set(RunKeys(run).evaluation, json.dumps(entry))
    return entry


def read(r, run: str, malformed: list[str] | None = None) -> dict | None:
    """The run's summary, or None (none made, or a record hsx did not write: named in ``malformed``)."""
    key = RunKeys(run).evaluation
    raw = r.get(key)
    return None if raw is None else records.decode(raw, key, [] if malformed is None else malformed, SHAPE, FIELDS)


def lines(e: dict) -> list[str]:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    out = [f"  drafter  {e['drafter']} (step {e['global_step']}): tau {num(e['tau'], '.2f')}, "
           f"{num(e['target_forwards_per_token'], '.3f')} target forwards/token, speedup {num(e['speedup'], '.2f')}x "
           f"on {e['device']}, {e['identical_prompts']}/{e['prompts']} prompts identical to target-only greedy"]
    if e["teacher_forced_accepted_prefix"] is not None:
        out.append(f"           teacher-forced accepted prefix {e['teacher_forced_accepted_prefix']:.2f} tokens a block "
                   "(stored states, no generation)")
    return out
