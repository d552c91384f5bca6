"""What `hsx status`, the dashboard and /metrics show: the face of the wing.

A run's progress from its ledger, a long step's progress line, whether a plan is whole (and the plan, read
warily), the throughput chart, hosts' upload rates, and the last evaluation of a drafter trained on the run.
It reads the other wings and writes nothing of a batch's life. Everything not named in ``__all__`` is private
to the wing.
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from hsx.face import face
from hsx.monitor.evaluation import evaluation_summary
from hsx.monitor.planstate import plan_entries, plan_line, plan_tokens, planned_batches, window_spans
from hsx.monitor.progress import RATE_WINDOW_SECONDS, fmt_bytes, fmt_duration, host_row, run_progress, summary_lines
from hsx.monitor.progressline import Progress
from hsx.monitor.series import last_activity, throughput_series
from hsx.monitor.sources import source_lines, source_progress, with_source_lines
from hsx.monitor.uploadrate import host_upload_rate

__getattr__, __dir__, __all__ = face(__name__, __file__)
