"""What one tally process holds across its jobs: the sum so far."""

from __future__ import annotations

from dataclasses import dataclass

from hsx.fleet.role import Role

ADD_FUNC = "tests.toyrole.jobs.add"


@dataclass(frozen=True)
class TallyConfig:
    run: str
    redis_url: str
    host: str
    worker_name: str
    burst: bool
    heartbeat_seconds: float
    log_every_seconds: float


class TallyRuntime(Role):
    noun, command, jobs = "tally", "hsx tally", (ADD_FUNC,)

    def __init__(self, cfg: TallyConfig, r):
        super().__init__(cfg, r)
        self.run = cfg.run
        self.added = self.sum = 0

    def queue_names(self) -> list[str]:
        return [f"tally:{self.run}"]

    def totals(self) -> dict[str, int]:
        return {"batches": self.added, "sum": self.sum}

    def idle_line(self) -> str | None:
        return f"idle: tally {self.name} waits for jobs on tally:{self.run}" if self.queue_length(f"tally:{self.run}") == "0" else None

    def add(self, n: int) -> int:
        self.added, self.sum = self.added + 1, self.sum + n
        self.after_batch()
        return self.sum
