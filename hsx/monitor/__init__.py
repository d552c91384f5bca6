"""What `hsx status`, the dashboard and /metrics show: the face of the wing.

A run's progress from its ledger, a long step's progress line, whether a plan is whole (and the plan, read
warily), the throughput chart, hosts' upload rates, and the last evaluation of a drafter trained on the run.
It reads the other wings and writes nothing of a batch's life. Everything not named in ``__all__`` is private
to the wing.
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "evaluation": {"record": "record_evaluation"},
    "planstate": ["plan_entries", "plan_line", "plan_tokens", "planned_batches", "window_spans"],
    "progress": ["RATE_WINDOW_SECONDS", "fmt_bytes", "fmt_duration", "host_row", "run_progress", "summary_lines"],
    "progressline": ["Progress"],
    "series": ["last_activity", "throughput_series"],
    "sources": ["source_lines", "source_progress", "with_source_lines"],
    "uploadrate": ["host_upload_rate"],
})
