"""Plan a run and enqueue its batches, in five steps: ``produce()`` calls them in order.

- ``check``: the settings, Redis and the store, before anything is created;
- ``identify``: what the model and the layers are (hsx.runspec.identify, which `hsx inspect` calls too) and
  what the dataset is: the run's manifest (hsx.runspec.plan_manifest), then reconciled with an existing run's
  (resumed_manifest);
- ``resume``: under the producer lock, what the ledger, the queues and the window
  records of an earlier producer already hold;
- ``plan_windows``: tokenise, cut, write the inputs, save the plan, enqueue and
  record each window in turn;
- ``seal``: the manifest and the final totals, and on a re-run the index.

Re-running is safe: the plan is deterministic for the same dataset, model and
settings, inputs already in the store are not rewritten, and only batches
that are neither done nor pending get a job. A different manifest for an
existing run is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import replace

import redis

from hsx import life, runspec
from hsx.batch import INPUT_DIGEST_MISMATCH
from hsx.errors import HsxError
from hsx.fleet import check_eviction_policy
from hsx.monitor import Progress
from hsx.prep import (
    TokeniseSettings,
    Window,
    WindowTokeniser,
    check_budget,
    check_row_settings,
    cut_batches,
    cut_prefix_batches,
    default_workers,
    fingerprints,
    padding_fraction,
    resolve_dataset,
    resolve_model,
    resolve_store_url,
    weights_fingerprint,
)
from hsx.redisconn import connect, redact
from hsx.runspec import Manifest, ProduceConfig, plan_manifest, resumed_manifest
from hsx.store import check_store, layout
from producer import runweights, windows
from producer.inputs import write_inputs
from producer.planning import Planning
from producer.report import ProduceReport
from producer.windows import WindowRecord

log = logging.getLogger(__name__)


class PlanError(HsxError, RuntimeError):
    """The run cannot be planned; the message says why."""


class RejectShareExceeded(PlanError):
    """More than the allowed share of rows was rejected; nothing is left on the queue."""


def produce(cfg: ProduceConfig, on_event: Callable[[str, int], None] | None = None) -> ProduceReport:
    """Plan and enqueue the run window by window: check, identify, resume, plan windows, seal.
    ``on_event(name, window)`` sees "tokenised", "enqueued" and "recorded" as each window gets there
    (tests and progress)."""
    cfg, r = check(cfg)
    planned, named_fingerprint = identify(cfg)
    store = cfg.store.open()
    run = life.Run(r, cfg.run)
    existing = run.manifest() or Manifest.load(store, cfg.run)
    recorded = run.recorded_weights()
    runweights.say_unfingerprinted(planned, recorded)
    planned = runweights.comparable(planned, existing, recorded)
    manifest = resumed_manifest(existing, planned, named_fingerprint,
                                recorded["fingerprint"] if recorded and existing is not None else "")
    with run.producer_lock(cfg.lock_wait_seconds) as lock:
        planning = resume(Planning(r, store, cfg, lock), resumed=existing is not None)
        plan_windows(planning, manifest, on_event or (lambda name, window: None))
        manifest = seal(planning, manifest)
    return planning.produce_report(manifest)


def check(cfg: ProduceConfig) -> tuple[ProduceConfig, redis.Redis]:
    """Everything that can be wrong with the settings, Redis and the store, found before anything is created.
    Returns the settings with their paths resolved, and the Redis client."""
    layout.check_run_name(cfg.run)
    check_row_settings(cfg.overlong, cfg.max_reject_share)
    check_budget(cfg.max_length, cfg.token_budget, cfg.pad_multiple)
    # Paths are resolved once, here: the manifest holds them absolute for roles started anywhere (docs/architecture.md, rule 8).
    mixture = cfg.mixture.resolved() if cfg.mixture is not None else None
    cfg = replace(cfg, dataset=mixture.dataset if mixture else resolve_dataset(cfg.dataset), mixture=mixture,
                  model=resolve_model(cfg.model),
                  store=replace(cfg.store, url=resolve_store_url(cfg.store.url)))
    cfg.store.check_writable()
    r = connect(cfg.redis_url)
    check_eviction_policy(r, f"Redis at {redact(cfg.redis_url)}")
    check_store(cfg.store, "produce", run=cfg.run)  # an S3 store answers within 10 s, or one line says which setting
    return cfg, r


def identify(cfg: ProduceConfig) -> tuple[Manifest, str]:
    """The run's manifest as planned now, from what the model, the layers (hsx.runspec.identify: the one place a
    run's store dtype is chosen) and the dataset are; and the dataset's fingerprint as older hsx computed it (a
    run they planned resumes with it)."""
    target = runspec.identify(cfg)
    log.info("fingerprinting %s", cfg.dataset)
    mixture = cfg.mixture.records() if cfg.mixture is not None else []
    if mixture:   # the run's dataset is its sources as the manifest's mixture lists them, less their paths
        known = [{k: v for k, v in source.items() if k != "dataset"} for source in mixture]
        content_fingerprint = named_fingerprint = hashlib.sha256(json.dumps(known, sort_keys=True).encode()).hexdigest()
    else:
        content_fingerprint, named_fingerprint = fingerprints(cfg.dataset)
    facts = target.facts(content_fingerprint, weights_fingerprint(cfg.model), tuple(mixture))
    return plan_manifest(cfg, facts), named_fingerprint


def resume(planning: Planning, resumed: bool) -> Planning:
    """What is already true of the run: the ledger's done and pending batches, the windows an earlier producer
    recorded (their batches neither done nor pending are enqueued again). A fresh run finds none of it."""
    run = planning.run
    planning.planned_only = _mark_planned_only(run, planning.cfg.enqueue, new_run=not resumed)
    if not resumed:
        run.start_feeding()   # its queue is fed QUEUE_AHEAD jobs ahead, never the whole plan
    else:
        run.convert_old_ledger()   # a done ledger of an older hsx becomes this hsx's
    specs = run.all_specs() if resumed else {}   # read once: the check below and the earlier windows' specs
    listed = planning.store.list_sizes(f"{run.name}/batches/") if resumed else {}   # listed once: check and rebuild
    planning.repaired = len(run.unmark_missing_done(planning.store, specs, listed)) if resumed else 0
    planning.done = run.done_ids()
    # A re-run: the store is the second copy of the truth (docs/architecture.md, rule 2). Objects not in the ledger
    # (all of them after Redis lost the run) are checked and recorded done window by window.
    planning.rebuild = run.rebuilder(planning.store, planning.done, present=set(listed)) if resumed else None
    planning.pending = run.pending_extract()
    for host in run.read_hosts():
        planning.pending |= run.pending_upload(host)
    planning.first_pending = len(planning.pending)
    records, planning.suspect = _replan_bad_inputs(run, windows.load(run))
    for rec in records:
        planning.add(rec, resumed=True)
    if records:
        earlier = [spec for spec in (specs or run.all_specs()).values() if spec.index < planning.batches]
        if run.planning_in_progress():   # windows left to plan: their duplicate check needs every id so far
            ids = run.plan_ids(planning.store, {spec.batch_id: spec for spec in earlier})  # store
            earlier = [spec.with_ids(ids[spec.batch_id]) for spec in earlier]
            planning.seen = {sid for spec in earlier for sid in spec.sample_ids}
        if planning.rebuild is not None:
            planning.rebuild.check(earlier)
        planning.enqueued += _enqueue(planning, sorted(earlier, key=lambda s: s.index), planning.batches)
        log.info("run %s: windows 0-%d were planned by an earlier producer (%d batches; %d of them re-enqueued, "
                 "neither done nor pending)", run.name, len(records) - 1, planning.batches, planning.enqueued)
    return planning


def plan_windows(planning: Planning, manifest: Manifest, event: Callable[[str, int], None]) -> None:
    """Tokenise the windows after the resumed ones; plan, write, enqueue and record each as it comes."""
    cfg = planning.cfg
    settings = TokeniseSettings.of(cfg.model, cfg.max_length, cfg.overlong, cfg.template_kwargs, cfg.columns,
                                   cfg.mixture, cfg.per_turn)
    dataset = cfg.mixture if cfg.mixture is not None else cfg.dataset
    workers = cfg.tokenise_workers or default_workers(dataset)
    log.info("tokenising %s with %s's chat template on %d processes, %d rows a window",
             cfg.dataset, cfg.model, workers, cfg.window_rows)
    progress = Progress(f"tokenise {cfg.dataset.name} for run {cfg.run}", None, "rows")  # bar or log line
    with WindowTokeniser(dataset, settings, workers, cfg.window_rows, first_window=planning.resumed_windows,
                         seen=planning.seen, on_event=event, on_rows=progress.advance) as tokenised, progress:
        for window in tokenised:
            planning.report.merge(window.report)
            _check_reject_share(planning)
            if not window.samples:
                continue
            if not planning.manifest_saved:
                manifest.save(planning.store)
                planning.manifest_saved = True
            rec = _plan_window(planning, manifest, window)
            event("enqueued", window.number)
            windows.record(planning.run, window.number, rec)
            planning.add(rec, resumed=False)
            planning.enqueued += rec.enqueued
            planning.run.save_plan(manifest, [], planning.totals(planning=1))
            event("recorded", window.number)
            log.info("window %d: %d rows, %d batches (padding %.2f%%), %d tokens stored, %d computed, %d enqueued; "
                     "%d rows so far", window.number, window.report.rows, rec.batches, 100 * rec.padding, rec.tokens,
                     rec.computed_tokens, rec.enqueued, planning.report.rows)


def seal(planning: Planning, manifest: Manifest) -> Manifest:
    """The plan is whole: the manifest and the final totals are written; on a re-run, the failures of batches
    now done are dropped and the run's index is written if every batch is done. Returns the manifest written."""
    run = planning.run
    if not planning.batches:
        raise PlanError(f"{planning.cfg.dataset}: no usable rows out of {planning.report.rows}; nothing to plan. "
                        + "; ".join(planning.report.examples[:5]))
    manifest = runweights.with_recorded(run, manifest)   # a worker may have recorded it while this planned
    manifest.save(planning.store)
    run.save_plan(manifest, [], planning.totals(planning=0))
    if planning.rebuild is not None:
        settled = run.drop_failures_of_done()
        if settled:
            log.warning("run %s: %d batches are done but were still listed as failed or dead letters (%s); "
                        "those records are dropped", run.name, len(settled), ", ".join(settled[:10]))
    if planning.rebuild is not None and planning.rebuild.rebuilt:
        run.write_index_if_complete(planning.store)
    return manifest


def _mark_planned_only(run: life.Run, enqueue: bool, new_run: bool) -> bool:
    """``--no-enqueue`` on a new (or still plan-only) run marks it planned only, before any of its plan is in
    Redis: no reconciler of any role enqueues it (hsx/life/reconcile.py) until a `hsx produce` without the flag
    starts it, which removes the mark. A run already started stays started. True if the run is planned only."""
    if enqueue:
        run.unmark_planned_only()
        return False
    return run.mark_planned_only(new_run)


def _replan_bad_inputs(run: life.Run, records: list[WindowRecord]) -> tuple[list[WindowRecord], frozenset[str]]:
    """Windows from the first one holding a batch whose worker found its inputs corrupt (a failure or
    dead letter naming the digest mismatch) are planned again: same batch ids, inputs rewritten.

    Returns the window records kept and those batches: their input objects are checked by their bytes
    (the store's sha256 metadata is what the producer wrote, not what the object holds now)."""
    bad = [bid for rec in (*run.failures().items(), *run.dead_letters().items())
           for bid in [rec[0]] if INPUT_DIGEST_MISMATCH in str(rec[1].get("last_error", ""))]
    indexes = [int(bid[1:]) for bid in bad if bid[1:].isdigit()]
    if not indexes or not records:
        return records, frozenset(bad)
    first = min(indexes)
    keep = [rec for rec in records if rec.end_batch <= first]
    windows.forget_from(run, len(keep))
    log.warning("inputs of %s were found corrupt by workers: planning windows %d-%d again to rewrite them",
                sorted(bad)[:10], len(keep), len(records) - 1)
    return keep, frozenset(bad)


def _check_reject_share(planning: Planning) -> None:
    """Fail the run, with nothing left on the queue, once more than the allowed share of rows is rejected."""
    report, cfg = planning.report, planning.cfg
    if report.reject_share() <= cfg.max_reject_share:
        return
    withdrawn = windows.withdraw(planning.run) if planning.batches else 0
    reasons = ", ".join(f"{code} {n}" for code, n in report.rejected.most_common())
    raise RejectShareExceeded(
        f"{report.rejected_rows} of the {report.rows} rows read so far were rejected ({report.reject_share():.2%}), "
        f"more than --max-reject-share {cfg.max_reject_share:.2%}; stopped with nothing on the queue"
        + (f" ({withdrawn} batches of earlier windows taken back)" if withdrawn else "")
        + f". Rejected by reason: {reasons}. Examples:\n  " + "\n  ".join(report.examples[:10])
        + "\nFix the rows, map their columns (--columns), or raise --max-reject-share if this loss is intended.")


def _plan_window(planning: Planning, manifest: Manifest, window: Window) -> WindowRecord:
    """Cut, write inputs, save the plan and enqueue one window's batches; the window's record."""
    cfg, samples, first_batch = planning.cfg, window.samples, planning.batches
    if manifest.prefix_reuse == "on":   # shared prefixes computed once (hsx/prep/prefixplan.py)
        planned = cut_prefix_batches([s.input_ids for s in samples], cfg.token_budget, cfg.max_batch_rows,
                                     cfg.pad_multiple, manifest.prefix_min_tokens, manifest.prefix_cache_tokens,
                                     manifest.forward_tokens, manifest.stored_tokens,
                                     packed=manifest.rows_packed)
    else:
        planned = cut_batches([len(s.input_ids) for s in samples], cfg.token_budget, cfg.max_batch_rows,
                              cfg.pad_multiple)
    specs = []
    for offset, batch in enumerate(planned):
        index = first_batch + offset
        specs.append(life.BatchSpec(
            batch_id=layout.batch_id(index), index=index, shard=layout.shard_of(index, cfg.batches_per_shard),
            samples=len(batch.members), tokens=batch.tokens, padded=batch.padded, padded_len=batch.padded_len,
            sample_ids=[samples[i].sample_id for i in batch.members],
            prefix_groups=[list(g) for g in batch.groups], computed=batch.computed if batch.groups else 0,
            source=window.source))
    if planning.rebuild is not None:
        planning.rebuild.check(specs)
    specs = write_inputs(planning.store, cfg.run, samples, planned, specs, planning.done, planning.suspect)
    # The ids stay in the store (the inputs objects and the window's ids object), the plan keeps their digest
    planning.run.write_window_ids(planning.store, window.number, specs)
    planning.run.save_plan(manifest, [spec.for_plan() for spec in specs], {"planning": 1})
    enqueued = _enqueue(planning, specs, first_batch + len(specs))
    return WindowRecord(first_batch=first_batch, batches=len(specs), samples=len(samples),
                        tokens=sum(s.tokens for s in specs), padded_tokens=sum(s.padded for s in specs),
                        computed_tokens=sum(s.computed_tokens for s in specs),
                        padding=padding_fraction(planned), enqueued=enqueued, report=window.report,
                        source=window.source)


def _enqueue(planning: Planning, specs: list[life.BatchSpec], limit: int) -> int:
    """Enqueue the batches neither done nor pending, in one transaction that fails if the lock changed hands. A
    run fed in steps (``Run.feed``) gets jobs only for those of its batches fed already (below ``fed``: a job
    lost), then the queue topped up from the plan up to batch ``limit``; an older hsx's run, one for each."""
    if not planning.cfg.enqueue:
        return 0
    run = planning.run
    fed = run.fed_count()
    todo = [spec.batch_id for spec in specs if spec.batch_id not in planning.done
            and spec.batch_id not in planning.pending and (fed is None or spec.index < fed)]
    pipe = planning.lock.guarded_pipeline()
    run.enqueue(todo, first=True, pipe=pipe)
    fed_now = run.feed(limit, pipe=pipe) if fed is not None else 0
    planning.lock.execute(pipe)
    planning.pending.update(todo)
    return len(todo) + fed_now
