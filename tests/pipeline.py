"""Run the roles in-process (burst mode) for tests: produce -> worker -> uploaders."""

from __future__ import annotations

from pathlib import Path

from hsx.runspec.config import ProduceConfig, StoreSettings, UploadConfig, WorkerConfig
from hsx_tools.demo import sample_dataset


def produce_config(redis_url: str, model: Path, store: StoreSettings | str, run: str = "t1",
                   dataset: Path | None = None, **overrides) -> ProduceConfig:
    if isinstance(store, str):
        store = StoreSettings(url=store)
    fields = dict(run=run, dataset=dataset or sample_dataset(), model=str(model), layers="dflash:3", store=store,
                  redis_url=redis_url, token_budget=1024, max_length=1024, overlong="drop", max_batch_rows=64,
                  pad_multiple=1, dtype="float32", batches_per_shard=4, tokenise_workers=1)
    fields.update(overrides)
    return ProduceConfig(**fields)


def worker_config(redis_url: str, spool: Path, run: str = "t1", host: str = "testhost", **overrides) -> WorkerConfig:
    fields = dict(run=run, redis_url=redis_url, device="cpu", spool_dir=spool, spool_budget_bytes=2**40,
                  host=host, model_override=None, burst=True, worker_name=f"gpu-{host}-{run}", heartbeat_seconds=1.0,
                  prefix_forward_tokens=0)   # trees as planned: the exactness tests run them (test_prefix_reuse)
    fields.update(overrides)
    return WorkerConfig(**fields)


def upload_config(redis_url: str, spool: Path, host: str = "testhost", **overrides) -> UploadConfig:
    fields = dict(redis_url=redis_url, spool_dir=spool, host=host, burst=True, worker_name=f"upload-{host}",
                  heartbeat_seconds=1.0)
    fields.update(overrides)
    return UploadConfig(**fields)


def run_pipeline(redis_url: str, model: Path, store, spool: Path, run: str = "t1", **produce_overrides):
    """Plan, extract and upload a whole run in this process; return the produce report."""
    from gpu_worker.worker import run_worker
    from producer.produce import produce
    from uploader.worker import run_uploader

    report = produce(produce_config(redis_url, model, store, run=run, **produce_overrides))
    run_worker(worker_config(redis_url, spool, run=run))
    run_uploader(upload_config(redis_url, spool))
    return report


def planned_specs(r, run: str, store=None) -> dict:
    """The run's plan, batch id -> BatchSpec holding its sample ids: a plan in Redis keeps their digest, the ids
    are in the store (issue 42; ``Run.plan_ids``). ``store``: a Store, or the URL or path of one (None: the
    manifest's, a local store)."""
    from hsx import life
    from hsx.store import open_store

    ledger = life.Run(r, run)
    if store is None:
        store = ledger.require_manifest().store_url
    store = open_store(str(store)) if isinstance(store, (str, Path)) else store
    specs = ledger.all_specs()
    ids = ledger.plan_ids(store, specs)
    return {bid: spec.with_ids(ids[bid]) for bid, spec in specs.items()}
