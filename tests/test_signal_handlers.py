"""A role served in-process (tests/pipeline.py, bench) gives the process its SIGINT/SIGTERM handlers back (issue 29
item 12: rq's handler outlived run_pipeline, so `timeout`'s SIGTERM to the pytest session became an rq
StopRequested inside test_training_docs, the session ran on, and the session redis-server, killed by the same
group signal, was gone for every later test)."""

import os
import signal
import threading

import pytest

from hsx import retry
from hsx.fleet import RqWorker
from hsx.life import RunKeys
from tests.pipeline import upload_config
from tests.toyrole.runtime import TallyConfig, TallyRuntime
from tests.waiting import scaled
from uploader.worker import run_uploader

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def handlers() -> dict:
    return {s: signal.getsignal(s) for s in SIGNALS}


@pytest.fixture
def own_handlers():
    """Handlers of this test's own in place of the process's (rq's worker would otherwise find the defaults, and
    a role that put the defaults back rather than what it found would pass); the process's are put back after."""
    saved = handlers()
    mine = {s: (lambda signum, frame: None) for s in SIGNALS}
    for s, h in mine.items():
        signal.signal(s, h)
    yield mine
    for s, h in saved.items():
        signal.signal(s, h)


def tally(r, name: str) -> TallyRuntime:
    return TallyRuntime(TallyConfig(run="sig", redis_url="unused", host="testhost", worker_name=name, burst=True,
                                    heartbeat_seconds=1.0, log_every_seconds=60.0), r)


def test_an_in_process_role_gives_back_the_signal_handlers(redis_env, r, tmp_path, own_handlers):
    run_uploader(upload_config(redis_env, tmp_path / "spool"))       # burst, nothing queued: returns at once
    assert handlers() == own_handlers


class FailingWorker(RqWorker):
    """rq's loop ending in an error after it installed its handlers (a Redis error, a bug)."""

    def work(self, *args, **kwargs):
        self._install_signal_handlers()
        assert signal.getsignal(signal.SIGTERM) == self.request_stop   # rq's, while it serves
        raise RuntimeError("rq's loop failed")


def test_a_role_whose_rq_loop_fails_gives_them_back_too(r, own_handlers):
    with pytest.raises(RuntimeError, match="rq's loop failed"):
        tally(r, "tally-failing").serve(worker_class=FailingWorker)
    assert handlers() == own_handlers


class ThreadWorker(RqWorker):
    """A worker that can serve outside the main thread: it installs no signal handlers (rq's own raise there)."""

    def _install_signal_handlers(self):
        pass


def test_a_role_served_in_another_thread_leaves_the_handlers_alone(r, own_handlers):
    """signal.signal works only in the main thread: serving in another one must not fail on the way out."""
    raised = []

    def serve():
        try:
            tally(r, "tally-thread").serve(worker_class=ThreadWorker)
        except BaseException as exc:  # noqa: BLE001 - the test reports whatever the thread raised
            raised.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(timeout=scaled(60))
    assert not thread.is_alive() and raised == []
    assert handlers() == own_handlers


class StoppedWhileClosing(TallyRuntime):
    """A burst role that a SIGTERM meets after rq's loop, while it closes (issue 41 item 4: the demo's stop of its
    burst worker once the run was complete came while the worker drained and closed, and rq's handler raised
    StopRequested there: "hsx worker: unexpected error: StopRequested:" on a good run)."""

    closed = False

    def close(self):
        os.kill(os.getpid(), signal.SIGTERM)
        super().close()
        self.closed = True


class StoppedInTeardown(RqWorker):
    """rq's teardown (after its loop: register_death, unsubscribe) meets the SIGTERM."""

    def register_death(self):
        os.kill(os.getpid(), signal.SIGTERM)
        super().register_death()


@pytest.mark.parametrize("where", ["close", "teardown"])
def test_a_stop_after_rqs_loop_is_no_error_and_the_role_closes(where, r, own_handlers):
    role = (StoppedWhileClosing if where == "close" else type("T", (StoppedWhileClosing,), {"close": TallyRuntime.close}))(
        tally(r, f"tally-stopped-{where}").cfg, r)
    role.serve(worker_class=StoppedInTeardown if where == "teardown" else RqWorker)  # raised StopRequested
    assert role.closed or where == "teardown"
    assert not r.exists(RunKeys("sig").heartbeat(role.name))  # close() ran to its end: the heartbeat is gone
    assert retry.STOP.is_set()  # the stop request was taken: every wait of the closing role ends at once
    retry.STOP.clear()          # this process goes on (a role's serve() clears it too)
    assert handlers() == own_handlers
