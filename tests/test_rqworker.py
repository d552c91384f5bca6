"""rq's internals, reached only through hsx/fleet/rqworker.py, and still where that adapter expects them."""

from __future__ import annotations

import re
import signal
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib
from rq.exceptions import StopRequested

from hsx.fleet import RqWorker
from hsx.fleet.rqworker import PUBSUB_POLL_SECONDS

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("hsx", "gpu_worker", "uploader", "producer", "dashboard", "hsx_cli", "hsx_tools", "hsx_reader", "peers")
# rq's private state, the methods of its worker that hsx overrides and the worker class itself (imported): named
# nowhere else in product code
INTERNALS = re.compile(r"\b(_stop_requested|_shutdown_requested_date|dequeue_job_and_maintain_ttl|"
                       r"handle_warm_shutdown_request|_pubsub_exception_handler)\b|^from rq.* import .*SimpleWorker")


class Probe(RqWorker):
    dequeues = 0

    def before_dequeue(self) -> None:
        self.dequeues += 1


def test_rqs_internals_are_reached_only_through_the_adapter_which_rqs_loop_still_calls(r):
    requirement = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                       if re.match(r"rq\b", d))
    major = int(version("rq").split(".")[0])
    assert requirement.replace(" ", "") == f"rq>={major}.0,<{major + 1}", requirement  # below rq's next major

    reaching = [f"{p.relative_to(ROOT)}: {m.group(0)}" for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py"))
                if p != ROOT / "hsx/fleet/rqworker.py"
                for line in p.read_text().splitlines() if not line.lstrip().startswith("#")
                for m in INTERNALS.finditer(line)]
    assert reaching == []

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stops = []
    try:
        worker = Probe(["adapter"], connection=r, name="adapter-probe", on_stop_request=lambda: stops.append(1))
        worker.work(burst=True)                               # rq's loop: subscribe, one dequeue, teardown
        assert worker.dequeues == 1                           # dequeue_job_and_maintain_ttl is still rq's
        assert worker.pubsub_thread.sleep_time == PUBSUB_POLL_SECONDS  # subscribe is still rq's; its fields too
        closing = signal.getsignal(signal.SIGTERM)            # teardown is still rq's, and rq's first handler ours
        assert "_closing_handlers" in getattr(closing, "__qualname__", ""), closing
        closing(signal.SIGTERM, None)                         # after the loop: a stop, not StopRequested
        assert stops == [1] and worker.stop_requested
        assert signal.getsignal(signal.SIGTERM) == worker.request_force_stop

        again = Probe(["adapter"], connection=r, name="adapter-probe-2", on_stop_request=lambda: stops.append(2))
        with pytest.raises(StopRequested):                    # rq's own handler: warm shutdown, then its raise
            again.request_stop(signal.SIGTERM, None)
        assert stops == [1, 2] and again.stop_requested
        stopped = Probe(["adapter"], connection=r, name="adapter-probe-3")
        stopped.stop_taking_jobs()
        stopped.work(burst=False)                             # rq's loop reads the flag: returns, no job awaited
        assert stopped.dequeues == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
