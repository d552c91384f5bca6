"""`hsx verify`: the store against the plan.

Every planned batch must be done and present with the ledger's size and
SHA-256; its header must prove it is of this plan (run, batch id, sample ids, the
run's incarnation: hsx/life/provenance.py); hidden states finite; every
sample id exactly once across the run; no stray objects; no temp files left
by killed writers in a local store, no multipart upload of a killed uploader in S3
(hsx/fleet/multipart.py). ``--quick`` checks sizes only (no object
is read). ``--repair`` re-extracts every batch found bad (and removes stale
temp files); ``--rebuild-ledger`` first records done the planned batches
whose objects check out in full but the ledger lacks (after a Redis loss).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hsx import fleet, life
from hsx.monitor import Progress
from hsx.printable import printable
from hsx.runspec import RunLimits
from hsx.store import check_store, layout

log = logging.getLogger(__name__)
VERIFY_THREADS = 8   # store reads in flight
STALE_TEMP_SECONDS = 600  # --repair removes store temp files at least this old (a live write finishes sooner)


@dataclass
class VerifyReport:
    run: str
    planned: int = 0
    checked: int = 0
    samples: int = 0
    bytes: int = 0
    problems: dict[str, str] = field(default_factory=dict)   # batch id (or key) -> what is wrong
    duplicate_samples: list[str] = field(default_factory=list)
    missing_samples: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)      # hidden temp files of killed writers (local store)
    rebuilt: list[str] = field(default_factory=list)         # --rebuild-ledger: batches recorded done from the store
    repaired: list[str] = field(default_factory=list)        # --repair: batches re-enqueued
    removed_temp_files: list[str] = field(default_factory=list)
    stale_uploads: list[str] = field(default_factory=list)   # incomplete multipart uploads no live process holds
    live_uploads: int = 0                                     # incomplete multipart uploads in progress
    aborted_uploads: list[str] = field(default_factory=list)  # --repair: stale multipart uploads aborted

    @property
    def ok(self) -> bool:
        return not (self.problems or self.duplicate_samples or self.missing_samples or self.temp_files
                    or self.stale_uploads)

    def lines(self) -> list[str]:
        out = [f"run {self.run}: {self.checked}/{self.planned} batches verified, {self.samples} samples, "
               f"{self.bytes} bytes; {'OK' if self.ok else 'GAPS FOUND'}"]
        for bid, problem in sorted(self.problems.items())[:50]:
            out.append(f"  {bid}: {problem}")
        if len(self.problems) > 50:
            out.append(f"  ... and {len(self.problems) - 50} more")
        if self.duplicate_samples:
            out.append(f"  {len(self.duplicate_samples)} sample ids appear more than once, e.g. {self.duplicate_samples[:5]}")
        if self.missing_samples:
            out.append(f"  {len(self.missing_samples)} planned sample ids are missing, e.g. {self.missing_samples[:5]}")
        if self.temp_files:
            out.append(f"  {len(self.temp_files)} temp files of killed writers in the store, e.g. {self.temp_files[:3]}"
                       " (--repair removes those of a writer of this host that no longer runs, and any older than"
                       " 10 min)")
        if self.stale_uploads:
            out.append(f"  {len(self.stale_uploads)} incomplete multipart uploads of killed uploaders (billed storage, "
                       f"no object), e.g. {self.stale_uploads[:3]} (--repair or a starting uploader aborts them)")
        if self.live_uploads:
            out.append(f"  {self.live_uploads} multipart uploads in progress")
        if self.rebuilt:
            out.append(f"  rebuilt: {len(self.rebuilt)} batches recorded done from verified objects in the store")
        if self.repaired:
            out.append(f"  repair: {len(self.repaired)} batches re-enqueued for extraction: {self.repaired[:10]}")
        if self.removed_temp_files:
            out.append(f"  repair: removed {len(self.removed_temp_files)} stale temp files")
        if self.aborted_uploads:
            out.append(f"  repair: aborted {len(self.aborted_uploads)} stale multipart uploads")
        return out


def verify_run(r, store, run: str, quick: bool = False, repair: bool = False, rebuild: bool = False,
               progress_every_s: float | None = None) -> VerifyReport:
    """``progress_every_s``: seconds between progress lines in a log (None: 10; on a terminal a bar: hsx/monitor/progressline.py)."""
    ledger = life.Run(r, run)
    specs = ledger.all_specs()
    rebuilt = ledger.rebuild_done(store, specs, full=True) if rebuild else []
    infos = ledger.done_info()
    report = VerifyReport(run, planned=len(specs), rebuilt=rebuilt)

    manifest = ledger.manifest()
    incarnation = manifest.incarnation if manifest is not None else None

    ids = ledger.plan_ids(store, specs)   # a newer plan keeps them in the store
    specs = {bid: spec.with_ids(ids[bid]) for bid, spec in specs.items()}

    def one(bid):
        return bid, ledger.check_batch(store, specs[bid], infos.get(bid), quick, incarnation)

    seen: Counter = Counter()
    progress = Progress(f"verify {run}" + (" (sizes)" if quick else ""), len(specs), "batches", every_s=progress_every_s)
    with ThreadPoolExecutor(VERIFY_THREADS) as pool, progress:
        for bid, (problem, sample_ids) in pool.map(one, sorted(specs)):
            if problem:
                report.problems[bid] = problem
            else:
                report.checked += 1
                report.bytes += infos[bid]["size"]
            seen.update(sample_ids)
            progress.advance()
    planned_ids = [s for spec in specs.values() for s in spec.sample_ids]
    report.samples = sum(1 for s in set(planned_ids) if seen[s] >= 1)
    report.duplicate_samples = sorted(s for s, c in seen.items() if c > 1)
    report.missing_samples = sorted(set(planned_ids) - set(seen))
    expected_keys = {layout.batch_key(run, spec.shard, bid) for bid, spec in specs.items()}
    for key in store.list_keys(f"{run}/batches/"):
        if key not in expected_keys:
            report.problems[key] = "object is not in the plan"
    temp_files = getattr(store, "temp_files", None)  # a local store: hidden .<name>.tmp-<pid> files
    if temp_files is not None:
        report.temp_files = [str(p) for p, _ in temp_files(run)]
    lease_seconds = (manifest.limits if manifest is not None else RunLimits()).lease_seconds
    for upload in fleet.incomplete_uploads(r, store, run, lease_seconds):
        if upload.stale:
            report.stale_uploads.append(f"{upload.key} ({upload.age_seconds:.0f} s old)")
        else:
            report.live_uploads += 1
    if repair:
        report.aborted_uploads = [u.key for u in fleet.abort_stale_uploads(r, store, run, lease_seconds)]
        bad = sorted(bid for bid in report.problems if bid in specs and bid in infos)
        report.repaired = ledger.repair_batches(store, bad, specs) + ledger.requeue_orphans()
        if temp_files is not None:
            report.removed_temp_files = [str(p) for p in store.remove_temp_files(run, STALE_TEMP_SECONDS)]
    return report


@dataclass(frozen=True)
class VerifyConfig:
    redis_url: str
    run: str
    quick: bool = False      # sizes only; no object is read
    repair: bool = False     # re-extract batches found bad; remove stale store temp files
    rebuild_ledger: bool = False  # first record done the planned batches whose objects check out in full


def run_verify(cfg: VerifyConfig) -> int:
    from hsx.redisconn import connect

    r = connect(cfg.redis_url)
    settings = life.Run(r, cfg.run).require_manifest().store
    check_store(settings, "verify", write=cfg.repair, run=cfg.run)  # --repair deletes objects: it must write too
    store = settings.open()
    report = verify_run(r, store, cfg.run, quick=cfg.quick, repair=cfg.repair, rebuild=cfg.rebuild_ledger)
    print("\n".join(printable(line) for line in report.lines()))   # keys, sample ids: shown, not obeyed
    return 0 if report.ok else 1
