"""A run's evaluation: the last `hsx evaluate` of a drafter trained on the run (acceptance length, speedup).

`hsx evaluate --run R` writes the whole report beside the manifest as ``<run>/evaluation.json`` (in the
run's store) and a summary to Redis (``Run.record_evaluation``: hsx/life/notices.py keeps it, last writer wins),
which ``hsx status`` prints. The summary: ``{"drafter", "global_step", "tau", "target_forwards_per_token",
"speedup", "identical_prompts", "prompts", "teacher_forced_accepted_prefix", "device", "ts"}``; any field may be
None where it was not measured.
"""

from __future__ import annotations


def evaluation_summary(report: dict) -> dict:
    """The Redis summary of an `hsx evaluate` report (hsx_tools.evaluate)."""
    decode, forced = report.get("decode") or {}, report.get("teacher_forced") or {}
    drafter = report.get("drafter") or {}
    return {"drafter": drafter.get("checkpoint"), "global_step": drafter.get("global_step"), "tau": decode.get("tau"),
            "target_forwards_per_token": decode.get("target_forwards_per_token"), "speedup": decode.get("speedup"),
            "identical_prompts": decode.get("identical_prompts"), "prompts": decode.get("prompts"),
            "teacher_forced_accepted_prefix": forced.get("accepted_prefix_mean"), "device": report.get("device"),
            "ts": report.get("ts")}


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
