"""rq's worker as a role serves with it: the one module that reaches into rq's internals.

rq offers no public hook for what a role needs of its work loop, so each need is an override of a method of rq's
``Worker`` or a write of its private state, all here (rq is pinned below its next major in pyproject.toml;
tests/test_rqworker.py fails when an rq release moves one of them):

- ``subscribe``: rq's command channel (its pubsub thread) polled every PUBSUB_POLL_SECONDS, not rq's 60 s:
  redis-py's ``stop()`` joins that thread, so rq's teardown waited up to 60 s after the last job (a SIGTERMed
  uploader took 16-27 s to exit, sometimes 60);
- ``handle_warm_shutdown_request``: rq's first SIGTERM / SIGINT also calls ``on_stop_request`` (the job in hand
  finishes, its waits end now) and sets rq's ``_stop_requested``, also when rq's StopRequested meets a handler
  that swallows it;
- ``stop_taking_jobs`` / ``stop_requested``: rq's ``_stop_requested``, from any thread;
- ``dequeue_job_and_maintain_ttl``: ``before_dequeue`` first (a GPU worker holds off while its spool is full);
- ``teardown``: after rq's loop a stop request is no error (closing handlers, below), then rq's own teardown.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from rq.exceptions import StopRequested  # noqa: F401 - raised by rq's loop; roles catch it from here
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.worker import SimpleWorker

PUBSUB_POLL_SECONDS = 1.0  # s: rq's command listener thread wakes this often; a stopping role waits at most this


class RqWorker(SimpleWorker):
    """rq's in-process worker (no fork: a GPU worker's model stays loaded), JSON jobs only, with a role's hooks.

    ``on_stop_request``: called at the first stop request (a signal in rq's loop or after it), before rq's own
    warm shutdown. Subclasses may override ``before_dequeue``.
    """

    def __init__(self, *args, on_stop_request: Callable[[], None] | None = None, **kwargs):
        kwargs.setdefault("serializer", JSONSerializer)
        super().__init__(*args, **kwargs)
        self.on_stop_request = on_stop_request or (lambda: None)

    # ---- hsx's own verbs -----------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def stop_taking_jobs(self) -> None:
        """rq's loop ends after the job in hand (or at its next look, when idle): from any thread."""
        self._stop_requested = True

    def before_dequeue(self) -> None:
        """Called before each wait for a job; a subclass may hold off here (calling ``heartbeat`` meanwhile)."""

    # ---- rq's methods, overridden ------------------------------------------------------------
    def handle_warm_shutdown_request(self) -> None:
        self.on_stop_request()
        self._stop_requested = True
        super().handle_warm_shutdown_request()

    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        self.before_dequeue()
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

    def subscribe(self) -> None:
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub_thread = self.pubsub.run_in_thread(sleep_time=PUBSUB_POLL_SECONDS, daemon=True,
                                                       exception_handler=self._pubsub_exception_handler)

    def teardown(self) -> None:
        """rq's loop is over: a stop request from here on is no StopRequested."""
        self._closing_handlers()
        super().teardown()

    def _closing_handlers(self) -> None:
        """After rq's loop (its teardown, then the role's close()): rq's first-signal handler raises StopRequested
        wherever the main thread is unless a job runs, which there is an error out of serve() (the demo's SIGTERM
        to its burst worker, once the run was complete, met it while closing). In its place: a first stop request
        ends every wait (as in the loop) and the role closes; a second is rq's cold shutdown, as in the loop.
        Handlers that are no longer rq's first (a signal came in the loop, or none were set) stay as they are."""
        if threading.current_thread() is not threading.main_thread():
            return

        def first(signum, frame):
            self.handle_warm_shutdown_request()
            self._shutdown_requested_date = rq_now()  # rq ignores a second within 1 s of the first, as it does
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, self.request_force_stop)

        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) == self.request_stop:
                signal.signal(signum, first)
