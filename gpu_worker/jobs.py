"""rq job functions of the GPU worker. Kwargs are small JSON; the model lives in the runtime."""

from __future__ import annotations

from gpu_worker.runtime import WorkerRuntime


def extract_batch(run: str, batch_id: str, attempt: int | None = None) -> str:
    """``attempt``: carried by jobs an older hsx queued (a copy of the job id's suffix); never read."""
    rt = WorkerRuntime.current()
    if run != rt.run:
        raise ValueError(f"job of run {run!r} reached a worker of run {rt.run!r}")
    return rt.extract(batch_id)
