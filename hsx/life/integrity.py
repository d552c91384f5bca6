"""One batch object in the store checked against the plan and the ledger.

Used by `hsx verify` (every batch; ``--repair`` re-extracts the bad ones) and
by `hsx produce` on a re-run (done batches whose object is gone or of the
wrong size leave the ledger, so they are extracted again).
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from hsx.batch import BatchFileError, read_batch_bytes
from hsx.life import batchlife, ledger, provenance, reconcile
from hsx.store import ObjectNotFound, layout

log = logging.getLogger(__name__)
CHECK_THREADS = 8   # store requests in flight


def check_batch(store, run: str, spec: ledger.BatchSpec, info: dict | None, quick: bool,
                incarnation: str | None = None) -> tuple[str | None, list[str]]:
    """(problem or None, sample ids found) for one planned batch; ``incarnation`` (the run's, when given): the
    object's header must prove it is of this plan (hsx/life/provenance.py)."""
    if info is None:
        return "not done (not in the ledger)", []
    key = layout.batch_key(run, spec.shard, spec.batch_id)
    if quick:
        head = store.head(key)
        if head is None:
            return f"object {key} is missing from the store", []
        if head.size != info["size"]:
            return f"object {key} is {head.size} bytes, the ledger says {info['size']}", []
        return None, list(spec.sample_ids)
    try:
        data = store.get_bytes(key)
    except ObjectNotFound:
        return f"object {key} is missing from the store", []
    if len(data) != info["size"]:
        return f"object {key} is {len(data)} bytes, the ledger says {info['size']}", []
    if hashlib.sha256(data).hexdigest() != info["sha256"]:
        return f"object {key} has a different SHA-256 than the ledger recorded", []
    try:
        contents = read_batch_bytes(data, where=key)
    except BatchFileError as exc:
        return str(exc), []
    if not spec.ids_match(contents.sample_ids):
        return f"object {key} holds other samples than the plan", contents.sample_ids
    foreign = None if incarnation is None else provenance.mismatch(contents.metadata, run, spec, incarnation)
    if foreign:
        return f"object {key} is not of this plan: {foreign}", contents.sample_ids
    for name in ("hidden_states", "final_hidden_states"):
        t = getattr(contents, name)
        if t is not None and not bool(torch.isfinite(t).all()):
            return f"object {key}: {name} holds NaN/Inf", contents.sample_ids
    return None, contents.sample_ids


def unmark_missing_done(r, store, run: str, specs: dict[str, ledger.BatchSpec] | None = None,
                        listed: dict[str, int] | None = None) -> list[str]:
    """Take out of the ledger every done batch whose object is missing or of the wrong size (quick check).
    ``specs``: the run's plan, if the caller read it already (read here if None). The store is listed once with
    its objects' sizes (a HEAD a done batch was O(run) requests, and a local store's HEAD hashes the
    file); a batch whose object the listing does not show at the ledger's size is checked by its HEAD, as before,
    and leaves the ledger only if that finds it missing or of the wrong size. ``listed``: that listing, where the
    caller made it (``store.list_sizes(f"{run}/batches/")``; made here if None)."""
    specs = ledger.all_specs(r, run) if specs is None else specs
    infos = ledger.done_info(r, run)
    listed = store.list_sizes(f"{run}/batches/") if listed is None else listed
    doubtful = [bid for bid in sorted(set(infos) & set(specs))
                if listed.get(layout.batch_key(run, specs[bid].shard, bid)) != infos[bid]["size"]]

    def one(bid):
        return bid, check_batch(store, run, specs[bid], infos[bid], quick=True)[0]

    repaired = []
    with ThreadPoolExecutor(CHECK_THREADS) as pool:
        for bid, problem in pool.map(one, doubtful):
            if problem and batchlife.reopen(r, run, specs[bid], requeue=False):  # `hsx produce` queues it
                log.warning("%s was recorded done but %s; it will be extracted again", bid, problem)
                repaired.append(bid)
    return repaired


def repair_batches(r, store, run: str, bids: list[str], specs: dict[str, ledger.BatchSpec]) -> list[str]:
    """Re-extract done batches found bad: out of the ledger, bad object deleted, re-enqueued at the front.

    The bad object goes so that a ledger rebuild can never record it done again; the re-extracted
    object replaces it, and the index is written again once the run is complete.
    """
    repaired = []
    for bid in bids:
        spec = specs[bid]
        batchlife.reopen(r, run, spec, requeue=False)
        store.delete(layout.batch_key(run, spec.shard, bid))
        batchlife.enqueue(r, run, [bid], at_front=True)
        log.warning("%s: object was bad; taken out of the ledger and re-enqueued for extraction", bid)
        repaired.append(bid)
    return repaired


def requeue_orphans(r, run: str) -> list[str]:
    """Re-enqueue at once the planned batches in no queue, lease, ledger or dead letter (what the reconciler
    does after its grace period)."""
    found = sorted(reconcile.orphans(r, run, whole=True))
    batchlife.enqueue(r, run, found, at_front=True)
    return found
