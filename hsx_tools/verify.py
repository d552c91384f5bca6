"""`hsx verify`: the store against the plan.

Every planned batch must be done and present with the ledger's size and
SHA-256; its sample ids must be the plan's; hidden states finite; every
sample id exactly once across the run; no stray objects. ``--quick`` checks
sizes only (no object is read).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hsx import layout, ledger
from hsx.integrity import check_batch

log = logging.getLogger(__name__)
VERIFY_THREADS = 8   # store reads in flight


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

    @property
    def ok(self) -> bool:
        return not (self.problems or self.duplicate_samples or self.missing_samples)

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
        return out


def verify_run(r, store, run: str, quick: bool = False) -> VerifyReport:
    specs = ledger.all_specs(r, run)
    infos = ledger.done_info(r, run)
    report = VerifyReport(run, planned=len(specs))

    def one(bid):
        return bid, check_batch(store, run, specs[bid], infos.get(bid), quick)

    seen: Counter = Counter()
    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        for n, (bid, (problem, sample_ids)) in enumerate(pool.map(one, sorted(specs)), 1):
            if problem:
                report.problems[bid] = problem
            else:
                report.checked += 1
                report.bytes += infos[bid]["size"]
            seen.update(sample_ids)
            if n % 1000 == 0:
                log.info("verified %d/%d batches", n, len(specs))
    planned_ids = [s for spec in specs.values() for s in spec.sample_ids]
    report.samples = sum(1 for s in set(planned_ids) if seen[s] >= 1)
    report.duplicate_samples = sorted(s for s, c in seen.items() if c > 1)
    report.missing_samples = sorted(set(planned_ids) - set(seen))[:1000]
    expected_keys = {layout.batch_key(run, spec.shard, bid) for bid, spec in specs.items()}
    for key in store.list_keys(f"{run}/batches/"):
        if key not in expected_keys:
            report.problems[key] = "object is not in the plan"
    return report


@dataclass(frozen=True)
class VerifyConfig:
    redis_url: str
    run: str
    quick: bool = False      # sizes and checksums from metadata only


def run_verify(cfg: VerifyConfig) -> int:
    from hsx.config import StoreSettings
    from hsx.redisconn import connect

    r = connect(cfg.redis_url)
    manifest = ledger.require_manifest(r, cfg.run)
    store = StoreSettings.of_run(manifest).open()
    report = verify_run(r, store, cfg.run, quick=cfg.quick)
    print("\n".join(report.lines()))
    return 0 if report.ok else 1
