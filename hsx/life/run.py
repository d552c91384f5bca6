"""One handle on a run, rq's pattern (``Queue(name, connection=r)``): ``Run(r, name)``.

The handle carries the connection, the run's name, its keys and, on first use, its limits from the manifest
(``max_attempts``, ``lease_seconds``), so a caller names a batch and never passes the run or its limits back in:
``run.lease(bid)``, ``run.spool(...)``, ``run.fail(bid, error)``, ``run.is_done(bid)``, ``run.spec(bid)``,
``run.manifest()``. Its methods are the ledger's reads (here), a batch's changes of state and the roles' leases and
heartbeats (``RunVerbs``, hsx/life/runverbs.py), and the run's other records and checks (``RunRecords``,
hsx/life/runrecords.py). Each method is one call into the module that owns the record, so every Redis record of a
run is written by this wing. A handle holds no state of the run but its limits: make one where a run is named,
and keep it as long as its limits hold (a run's limits are fixed when it is planned).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis

from hsx.life import computeerror, donesequence, errorlog, idle, ledger, prefixerror, runstate, storeerror, windowrecords
from hsx.life.keys import RunKeys
from hsx.life.runrecords import RunRecords
from hsx.life.runverbs import RunVerbs

if TYPE_CHECKING:
    from hsx.life.ledger import BatchSpec, Manifest
    from hsx.runspec import RunLimits


class Run(RunRecords, RunVerbs):
    """``Run(r, name)``: the run ``name`` in the Redis ``r``; ``limits`` given, the manifest is not read for them."""

    ERROR_SAMPLE_EVERY = storeerror.ERROR_SAMPLE_EVERY        # a batch in this many records its store error
    PREFIX_WARN_REL_L2 = prefixerror.PREFIX_WARN_REL_L2        # a reused prefix's error above this is flagged
    BF16_REFERENCE = computeerror.BF16_REFERENCE               # the references a compute error is measured against
    DEQUANTISED_REFERENCE = computeerror.DEQUANTISED_REFERENCE
    WRITTEN_BYTES = ledger.WRITTEN_BYTES                       # the totals' field of bytes written

    def __init__(self, r: redis.Redis, name: str, limits: RunLimits | None = None):
        self.r, self.name, self.keys = r, name, RunKeys(name)
        self._limits = limits

    def __repr__(self) -> str:
        return f"Run({self.name!r})"

    @classmethod
    def names(cls, r: redis.Redis) -> list[str]:
        """Every run with a manifest in ``r``."""
        return ledger.list_runs(r)

    @property
    def limits(self) -> RunLimits:
        """The run's limits, read from its manifest once (RunVanished when it has none)."""
        if self._limits is None:
            self._limits = self.require_manifest().limits
        return self._limits

    # ---- the run as a whole ------------------------------------------------
    def exists(self) -> bool:
        return runstate.run_exists(self.r, self.name)

    def manifest(self) -> Manifest | None:
        return ledger.get_manifest(self.r, self.name)

    def require_manifest(self) -> Manifest:
        return ledger.require_manifest(self.r, self.name)

    def complete(self) -> bool:
        return idle.run_complete(self.r, self.name)

    def planning_in_progress(self) -> bool:
        return runstate.planning_in_progress(self.r, self.name)

    def outstanding(self) -> runstate.Outstanding:
        return runstate.outstanding(self.r, self.name)

    # ---- the plan and the done ledger --------------------------------------
    def spec(self, bid: str) -> BatchSpec | None:
        return ledger.get_spec(self.r, self.name, bid)

    def specs(self, bids: list[str]) -> list[BatchSpec]:
        return ledger.get_specs(self.r, self.name, bids)

    def all_specs(self) -> dict[str, BatchSpec]:
        return ledger.all_specs(self.r, self.name)

    def is_done(self, bid: str) -> bool:
        return ledger.is_done(self.r, self.name, bid)

    def done_ids(self) -> set[str]:
        return ledger.done_ids(self.r, self.name)

    def done_among(self, bids: list[str]) -> set[str]:
        return ledger.done_among(self.r, self.name, bids)

    def done_count(self) -> int:
        return ledger.done_count(self.r, self.name)

    def done_counters(self) -> dict[str, int]:
        return ledger.done_counters(self.r, self.name)

    def done_info(self) -> dict[str, dict]:
        return ledger.done_info(self.r, self.name)

    def done_record(self, bid: str) -> dict | None:
        return ledger.done_record(self.r, self.name, bid)

    def done_records(self, bids: list[str]) -> dict[str, dict | None]:
        return ledger.done_records(self.r, self.name, bids)

    def uploaded_since(self, host: str, since: float) -> list[str]:
        return ledger.uploaded_since(self.r, self.name, host, since)

    def failures(self, malformed: list[str] | None = None) -> dict[str, dict]:
        return ledger.failures(self.r, self.name, malformed)

    def dead_letters(self, malformed: list[str] | None = None) -> dict[str, dict]:
        return ledger.dead_letters(self.r, self.name, malformed)

    def recent_failures(self, malformed: list[str] | None = None) -> list[dict]:
        return errorlog.recent_failures(self.r, self.name, malformed)

    # ---- the done sequence (followers) and the producer's windows ----------
    def sequence_done(self) -> int:
        return donesequence.sequence_done(self.r, self.name)

    def sequence_generation(self) -> str:
        return donesequence.sequence_generation(self.r, self.name)

    def sequence_window(self, position: int) -> donesequence.SequenceWindow:
        return donesequence.sequence_window(self.r, self.name, position)

    def sequence_length(self) -> int:
        return donesequence.sequence_length(self.r, self.name)

    def window_records(self) -> dict[int, bytes]:
        return windowrecords.window_records(self.r, self.name)

    def save_window(self, number: int, record_json: str) -> None:
        windowrecords.save_window(self.r, self.name, number, record_json)

    def forget_windows_from(self, number: int) -> None:
        windowrecords.forget_windows_from(self.r, self.name, number)
