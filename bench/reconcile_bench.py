"""Cost of one reconciler pass on a large run: a private redis-server, a synthetic plan.

    .venv/bin/python bench/reconcile_bench.py [--batches 20000]

Plans N batches (specs of 64 sample ids each), marks half done, enqueues a
quarter as real rq jobs, leases 64, orphans the rest, then times
``reconcile.orphans`` (the read side of every pass) and one full pass.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from hsx.life import batchlife, leases, ledger, reconcile
from hsx.life.keys import RunKeys
from hsx.redisconn import LocalRedis, connect


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20000)
    args = ap.parse_args()
    n, run = args.batches, "bench"
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(tmp) as server:
        r = connect(server.url)
        specs = [ledger.BatchSpec(f"b{i:07d}", i, f"{i // 1000:05d}", 64, 64 * 500, 64 * 512, 512,
                                  [f"s{i}-{j}" for j in range(64)], "0" * 64) for i in range(n)]
        ledger.save_plan(r, run, {"run": run}, specs, {"batches": n})
        keys = RunKeys(run)
        for spec in specs[: n // 2]:
            ledger.mark_done(r, run, spec, "k", 1, "0" * 64, by="bench")
        batchlife.enqueue(r, run, [spec.batch_id for spec in specs[n // 2: 3 * n // 4]], first=True)
        for spec in specs[3 * n // 4: 3 * n // 4 + 64]:
            leases.take(r, keys.extract_leases, spec.batch_id, 60)
        expected = n - n // 2 - (3 * n // 4 - n // 2) - 64
        t0 = time.perf_counter()
        found = reconcile.orphans(r, run)
        t_read = time.perf_counter() - t0
        assert len(found) == expected, (len(found), expected)
        reconcile.reconcile(r, run, grace=0)
        t0 = time.perf_counter()
        requeued = reconcile.reconcile(r, run, grace=0)
        t_pass = time.perf_counter() - t0
        t0 = time.perf_counter()
        reconcile.reconcile(r, run, grace=0)
        t_quiet = time.perf_counter() - t0
        print(f"{n} planned, {n // 2} done, {3 * n // 4 - n // 2} queued, 64 leased, {expected} orphaned")
        print(f"orphans() read: {t_read * 1000:.0f} ms; pass re-enqueueing {len(requeued)}: {t_pass * 1000:.0f} ms; "
              f"next pass (nothing to do): {t_quiet * 1000:.0f} ms")


if __name__ == "__main__":
    main()
