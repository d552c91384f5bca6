"""The ledger rebuilt from the store: the store is the second copy of the truth.

After Redis lost a run (restarted empty, flushed), re-running `hsx produce`
saves the same plan again and, before anything is enqueued, records done
every planned batch whose object is in the store and checks out:

- its size is the store's (S3: ContentLength) and the size its own header describes;
- its header names this run, this batch id and exactly the plan's sample ids
  (``hsx-batch/1`` format);
- the store knows its SHA-256 (S3: the ``sha256`` metadata the uploader wrote
  and verified; a local store hashes the file), which becomes the ledger's.

``full=True`` (``hsx verify --rebuild-ledger``) also reads every such object,
re-hashes it against that SHA-256 and decodes it (finite hidden states). Cost
of the default: one LIST of ``<run>/batches/`` plus, per object not already
in the ledger, a HEAD and one range read of its header; with the ledger
intact that set is empty or a handful of in-flight uploads.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from hsx.batch import FORMAT, BatchFileError, read_batch_bytes, read_header
from hsx.life import batchlife, ledger
from hsx.store import ObjectNotFound, layout

log = logging.getLogger(__name__)
THREADS = 8  # store requests in flight


def check_object(store, run: str, spec: ledger.BatchSpec, full: bool) -> tuple[str | None, int, str | None]:
    """(problem or None, size, sha256) of the stored object of ``spec``, without the ledger."""
    key = layout.batch_key(run, spec.shard, spec.batch_id)
    head = store.head(key)
    if head is None:
        return "missing", 0, None
    if not head.sha256:
        return "the store has no SHA-256 for it", head.size, None
    try:
        header = read_header(lambda start, length: store.get_bytes(key, start, length), key)
        described = header.size
    except ObjectNotFound:
        return "missing", 0, None
    except BatchFileError as exc:
        return str(exc), head.size, None
    if described != head.size:
        return f"{head.size} bytes, its header describes {described}", head.size, None
    names, wanted = [header.metadata["format"], header.meta.run, header.meta.batch_id], [FORMAT, run, spec.batch_id]
    if names != wanted:
        return f"header names {names}, want {wanted}", head.size, None
    if not spec.ids_match(header.meta.sample_ids):
        return "holds other samples than the plan", head.size, None
    if full:
        data = store.get_bytes(key)
        if hashlib.sha256(data).hexdigest() != head.sha256:
            return "SHA-256 differs from the one recorded with it", head.size, None
        try:
            contents = read_batch_bytes(data, where=key)
        except BatchFileError as exc:
            return str(exc), head.size, None
        for t in (contents.hidden_states, contents.final_hidden_states):
            if t is not None and not bool(torch.isfinite(t).all()):
                return "hidden states hold NaN/Inf", head.size, None
    return None, head.size, head.sha256


class Rebuild:
    """The producer's rebuild, window by window: the store is listed once, each window's specs checked.
    ``present``: the run's batch keys in the store, where the caller listed them already (listed here if None)."""

    def __init__(self, r, store, run: str, done: set[str], present: set[str] | None = None):
        self.r, self.store, self.run, self.done = r, store, run, done   # ``done`` gains what is rebuilt
        self.present = set(store.list_keys(f"{run}/batches/")) if present is None else present
        self.rebuilt: list[str] = []

    def check(self, specs: list[ledger.BatchSpec]) -> list[str]:
        found = rebuild_done(self.r, self.store, self.run, specs, present=self.present, done=self.done)
        self.rebuilt.extend(found)
        return found


def rebuild_done(r, store, run: str, specs: dict[str, ledger.BatchSpec] | list[ledger.BatchSpec],
                 full: bool = False, present: set[str] | None = None, done: set[str] | None = None) -> list[str]:
    """Record done every planned batch not in the ledger whose stored object checks out; return their ids.

    ``present``: the run's batch keys in the store (listed here if None); ``done``: the ledger's ids
    (read here if None; a given set gains the ids rebuilt).
    """
    if not isinstance(specs, dict):
        specs = {s.batch_id: s for s in specs}
    done = ledger.done_ids(r, run) if done is None else done
    present = set(store.list_keys(f"{run}/batches/")) if present is None else present
    todo = [s for bid, s in sorted(specs.items())
            if bid not in done and layout.batch_key(run, s.shard, bid) in present]
    if not todo:
        return []
    log.info("checking %d stored objects of run %s that the ledger does not list", len(todo), run)

    def one(spec):
        return spec, check_object(store, run, spec, full)

    rebuilt = []
    with ThreadPoolExecutor(THREADS) as pool:
        for spec, (problem, size, sha) in pool.map(one, todo):
            key = layout.batch_key(run, spec.shard, spec.batch_id)
            if problem:
                log.warning("%s: not recorded done (%s); it will be extracted again", key, problem)
                continue
            if batchlife.finish(r, run, spec, key, size, sha, by="rebuilt from the store"):
                rebuilt.append(spec.batch_id)
            done.add(spec.batch_id)
    if rebuilt:
        log.warning("rebuilt %d ledger entries of run %s from verified objects in the store", len(rebuilt), run)
    return rebuilt
