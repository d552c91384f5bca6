"""Thread counts of the test processes: one compute thread each, unless HSX_TEST_THREADS says otherwise.

On a loaded machine a torch process with a thread a core fights every other process for those cores (threads
spinning at barriers, waiting for a sibling that is not running): building the sharp target with torch's
default 2 threads at load 12-30 had not finished after 33 min, with 1 thread it took 6 min. The suite is many
processes (pytest, its workers, redis, the peers' trainers) on a 2-core box, so each computes on one thread.
conftest.py pins the pytest process and its environment at start; every subprocess the tests start inherits
that environment (peerenv.peer_env sets it again for the peers' venvs)."""

from __future__ import annotations

import os

# the variables the thread pools read: OpenMP (torch's intra-op pool), MKL, OpenBLAS, numexpr, rayon (tokenizers)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "RAYON_NUM_THREADS")


def threads_per_process() -> int:
    """HSX_TEST_THREADS (a positive integer) or 1."""
    value = os.environ.get("HSX_TEST_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HSX_TEST_THREADS={value!r}: want a positive integer")
    return int(value)


def thread_env() -> dict[str, str]:
    """The environment variables that give a process ``threads_per_process()`` compute threads."""
    return dict.fromkeys(THREAD_VARIABLES, str(threads_per_process()))


def pin_threads() -> int:
    """This process (torch's pools) and the environment its subprocesses inherit: ``threads_per_process()`` threads."""
    import torch

    threads = threads_per_process()
    os.environ.update(thread_env())
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:   # only before torch's first parallel work; the intra-op pool is what computes
        pass
    return threads
