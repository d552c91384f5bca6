"""A run handle's records and checks (``RunRecords``, a part of ``hsx.life.Run``): the weights a run was made
with, the measured FP8 compute and prefix-reuse errors, the store's errors, the notices its roles leave
(hsx/life/notices.py), and the checks and repairs of the ledger against the store (reconcile, integrity,
rebuild, the index, reset, an old ledger converted). Each is one call into the module that owns the record.

Modules that import rq or a store client are imported on first use, inside the methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import redis

from hsx.life import computeerror, ledger, notices, oldledger, prefixerror, runstate, storeerror, weightsrecord
from hsx.life.producerlock import ProducerLock

if TYPE_CHECKING:
    from hsx.life.keys import RunKeys
    from hsx.life.ledger import BatchSpec, Manifest
    from hsx.life.rebuild import Rebuild
    from hsx.life.reset import ResetPlan
    from hsx.runspec import RunLimits


class RunRecords:
    r: redis.Redis
    name: str
    keys: RunKeys
    limits: RunLimits

    # ---- the weights and the measured errors ------------------------------
    def record_weights(self, fingerprint: str, model: str, worker: str, host: str,
                       manifest: Manifest | None = None) -> dict:
        return weightsrecord.record_weights(self.r, self.name, fingerprint, model, worker, host, manifest)

    def recorded_weights(self) -> dict | None:
        return weightsrecord.recorded_weights(self.r, self.name)

    def claim_compute_error(self, worker: str) -> bool:
        return computeerror.claim_compute_error(self.r, self.name, worker, self.limits.lease_seconds)

    def compute_error_recorded(self) -> bool:
        return computeerror.compute_error_recorded(self.r, self.name)

    def record_compute_error(self, bid: str, manifest: Manifest, error, tokens: int, reference: str, worker: str,
                             pipe=None) -> dict:
        return computeerror.record_compute_error(self.r, self.name, bid, manifest, error, tokens, reference, worker,
                                                 pipe=pipe)

    def compute_error(self, malformed: list[str] | None = None) -> dict | None:
        return computeerror.compute_error(self.r, self.name, malformed)

    def prefix_error_recorded(self) -> bool:
        return prefixerror.prefix_error_recorded(self.r, self.name)

    def record_prefix_error(self, bid: str, layer_ids, error, groups: int, tokens: int, worker: str) -> dict:
        return prefixerror.record_prefix_error(self.r, self.name, bid, layer_ids, error, groups, tokens, worker)

    prefix_error_line = staticmethod(prefixerror.prefix_error_line)   # the one-line report of a prefix record

    def prefix_error(self, malformed: list[str] | None = None) -> dict | None:
        return prefixerror.prefix_error(self.r, self.name, malformed)

    def record_store_error(self, bid: str, manifest: Manifest, error, tokens: int, pipe=None) -> None:
        storeerror.record_store_error(self.r, self.name, bid, manifest, error, tokens, pipe=pipe)

    def store_error_summary(self, malformed: list[str] | None = None) -> dict | None:
        return storeerror.store_error_summary(self.r, self.name, malformed)

    # ---- notices: a refusing store, refused uploads, an evaluation ---------
    def record_store_refusal(self, bid: str, error: str, by: str) -> None:
        notices.record_store_refusal(self.r, self.name, bid, error, by)

    def clear_store_refusal(self) -> None:
        notices.clear_store_refusal(self.r, self.name)

    def store_refusal(self) -> dict | None:
        return notices.store_refusal(self.r, self.name)

    def record_refused_upload(self, host: str, cause: str, message: str) -> None:
        notices.record_refused_upload(self.r, self.name, host, cause, message)

    def clear_refused_uploads(self, host: str) -> None:
        notices.clear_refused_uploads(self.r, self.name, host)

    def refused_uploads(self) -> dict[str, dict]:
        return notices.refused_uploads(self.r, self.name)

    def record_evaluation(self, entry: dict) -> None:
        notices.record_evaluation(self.r, self.name, entry)

    def evaluation(self, malformed: list[str] | None = None) -> dict | None:
        return notices.evaluation(self.r, self.name, malformed)

    # ---- the plan's state -------------------------------------------------
    def producer_lock(self, wait_seconds: float = 0.0) -> ProducerLock:
        """The run's producer lock, to hold with ``with``: ProducerBusy while another producer holds it."""
        return ProducerLock(self.r, self.name, wait_seconds)

    def mark_planned_only(self, new_run: bool) -> bool:
        return runstate.mark_planned_only(self.r, self.name, new_run)

    def unmark_planned_only(self) -> None:
        runstate.unmark_planned_only(self.r, self.name)

    def drop_failures_of_done(self) -> list[str]:
        return ledger.drop_failures_of_done(self.r, self.name)

    def convert_old_ledger(self) -> int:
        return oldledger.convert_old_ledger(self.r, self.name)

    # ---- sample ids in the store ------------------------------------------
    def write_window_ids(self, store, number: int, specs: list[BatchSpec]) -> None:
        from hsx.life import planids
        planids.write_window_ids(store, self.name, number, specs)

    def plan_ids(self, store, specs: dict[str, BatchSpec]) -> dict[str, list[str]]:
        from hsx.life import planids
        return planids.plan_ids(self.r, store, self.name, specs)

    def with_ids(self, store, spec: BatchSpec) -> BatchSpec:
        from hsx.life import planids
        return planids.with_ids(store, self.name, spec)

    # ---- the ledger against the queues and the store -----------------------
    def maybe_reconcile(self) -> list[str] | None:
        from hsx.life import reconcile
        return reconcile.maybe_reconcile(self.r, self.name, self.limits.lease_seconds / 2)

    def orphans(self) -> set[str]:
        from hsx.life import reconcile
        return reconcile.orphans(self.r, self.name)

    def file_mismatch(self, path: Path, spec: BatchSpec, incarnation: str) -> str | None:
        from hsx.life import provenance
        return provenance.file_mismatch(path, self.name, spec, incarnation)

    def check_batch(self, store, spec: BatchSpec, info: dict | None, quick: bool,
                    incarnation: str | None = None) -> tuple[str | None, list[str]]:
        from hsx.life import integrity
        return integrity.check_batch(store, self.name, spec, info, quick, incarnation)

    def unmark_missing_done(self, store, specs: dict[str, BatchSpec] | None = None,
                            listed: dict[str, int] | None = None) -> list[str]:
        from hsx.life import integrity
        return integrity.unmark_missing_done(self.r, store, self.name, specs, listed)

    def repair_batches(self, store, bids: list[str], specs: dict[str, BatchSpec]) -> list[str]:
        from hsx.life import integrity
        return integrity.repair_batches(self.r, store, self.name, bids, specs)

    def requeue_orphans(self) -> list[str]:
        from hsx.life import integrity
        return integrity.requeue_orphans(self.r, self.name)

    def rebuild_done(self, store, specs: dict[str, BatchSpec] | list[BatchSpec], full: bool = False,
                     present: set[str] | None = None, done: set[str] | None = None) -> list[str]:
        from hsx.life import rebuild
        return rebuild.rebuild_done(self.r, store, self.name, specs, full=full, present=present, done=done)

    def rebuilder(self, store, done: set[str], present: set[str] | None = None) -> Rebuild:
        """The producer's rebuild, window by window (``done`` gains what it records done)."""
        from hsx.life import rebuild
        return rebuild.Rebuild(self.r, store, self.name, done, present)

    def write_index_if_complete(self, store) -> bool:
        from hsx.life import index
        return index.write_index_if_complete(self.r, store, self.name)

    def plan_reset(self, store=None, allow_live: bool = False) -> ResetPlan:
        from hsx.life import reset
        return reset.plan_reset(self.r, self.name, store, allow_live)

    def apply_reset(self, plan: ResetPlan, store=None) -> None:
        from hsx.life import reset
        reset.apply_reset(self.r, plan, store)
