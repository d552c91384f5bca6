"""Issue 29 item 1: a reset run never takes the old plan's spool files as its own batches.

`hsx reset --run R --store S`, then a new `hsx produce` of R, with the old worker's spool still on the host.
Before: the spool recovery re-enqueued every complete ``R/<batch>.safetensors`` and the uploader checked only size
and SHA-256 against the job, so (1) with another checkpoint of the same config the store held the old model's
hidden states and `hsx verify` said OK; (2) with another token budget batches held other sample sets, the run said
COMPLETE and a full verify found ids missing. A batch file now proves it belongs (run, batch id, sample ids, the
run's incarnation; hsx/life/provenance.py): checked at recovery, before upload and by `hsx verify`.

Both cases run through the real roles, in the order that let the old files through: the new worker recovers its
spool, an uploader runs, then the worker extracts, then the uploader again.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from gpu_worker.worker import load_runtime, run_worker
from hsx.batch import batchfile
from hsx.life import doneledger, ledger
from hsx.life.keys import RunKeys
from hsx.store import layout, open_store
from hsx_cli.main import main
from hsx_tools.demo import sample_dataset
from hsx_tools.verify import verify_run
from producer.produce import produce
from tests.pipeline import planned_specs, produce_config, run_pipeline, upload_config, worker_config
from uploader.worker import run_uploader

RUN = "inc"


@pytest.fixture
def rows(tmp_path):
    """40 rows of the sample conversations: a run of a few batches (the machine is shared)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:40]))
    return path


def stored(store_dir, run: str) -> dict[str, batchfile.BatchContents]:
    store = open_store(str(store_dir))
    return {key.rsplit("/", 1)[1].removesuffix(".safetensors"): batchfile.read_batch_bytes(store.get_bytes(key), key)
            for key in store.list_keys(f"{run}/batches/")}


def old_spool_then_reset(redis_url, model, store_dir, spool, **settings) -> int:
    """Plan R and extract it without uploading (the spool keeps every batch), then reset R with its store."""
    produce(produce_config(redis_url, model, str(store_dir), run=RUN, **settings))
    run_worker(worker_config(redis_url, spool, run=RUN))
    assert not list(store_dir.glob(f"{RUN}/batches/*/*"))   # nothing uploaded: the spool holds every batch
    files = len(list((spool / RUN).glob("*.safetensors")))
    assert main(["reset", "--run", RUN, "--store", str(store_dir), "--yes"]) == 0
    return files


def rerun_in_the_order_that_mixed(redis_url, model, store_dir, spool, **settings):
    produce(produce_config(redis_url, model, str(store_dir), run=RUN, **settings))
    wcfg = worker_config(redis_url, spool, run=RUN)
    rt = load_runtime(wcfg)
    rt.recovery.recover()                            # what a restarted worker does first
    run_uploader(upload_config(redis_url, spool))    # uploads whatever recovery enqueued
    run_worker(wcfg, rt)
    run_uploader(upload_config(redis_url, spool))


def test_another_checkpoint_of_the_same_config_after_a_reset(r, redis_server, redis_env, tiny_model, other_checkpoint, tmp_path,
                                                              rows):
    store_dir, spool = tmp_path / "store", tmp_path / "spool"
    assert old_spool_then_reset(redis_server.url, tiny_model, store_dir, spool, dataset=rows, token_budget=512,
                                max_length=512, overlong="truncate") > 1
    rerun_in_the_order_that_mixed(redis_server.url, other_checkpoint, store_dir, spool, dataset=rows,
                                  token_budget=512, max_length=512, overlong="truncate")
    # What the new checkpoint computes for the same plan, in a run of its own.
    run_pipeline(redis_server.url, other_checkpoint, str(tmp_path / "ref-store"), tmp_path / "ref-spool", run="ref",
                 dataset=rows, token_budget=512, max_length=512, overlong="truncate")
    got, want = stored(store_dir, RUN), stored(tmp_path / "ref-store", "ref")
    assert sorted(got) == sorted(want)
    old_model = [bid for bid in sorted(want)
                 if not torch.equal(got[bid].hidden_states, want[bid].hidden_states)]
    assert not old_model, f"{len(old_model)} of {len(want)} batches hold another model's hidden states: {old_model[:5]}"
    incarnation = ledger.get_manifest(r, RUN).incarnation
    assert len(incarnation) == 32 and {c.metadata["incarnation"] for c in got.values()} == {incarnation}
    assert verify_run(r, open_store(str(store_dir)), RUN).ok


def test_another_token_budget_after_a_reset(r, redis_server, redis_env, tiny_model, tmp_path, rows):
    store_dir, spool = tmp_path / "store", tmp_path / "spool"
    old_spool_then_reset(redis_server.url, tiny_model, store_dir, spool, dataset=rows, token_budget=1024)
    rerun_in_the_order_that_mixed(redis_server.url, tiny_model, store_dir, spool, dataset=rows, token_budget=512,
                                  max_length=512, overlong="truncate")
    specs = planned_specs(r, RUN, store_dir)   # ids from the store (issue 42)
    got = stored(store_dir, RUN)
    assert set(got) == set(specs), (sorted(set(specs) - set(got)), ledger.failures(r, RUN), ledger.dead_letters(r, RUN),
                                    ledger.run_totals(r, RUN), len(ledger.done_ids(r, RUN)))
    other = sorted(bid for bid, spec in specs.items() if got[bid].sample_ids != spec.sample_ids)
    assert not other, f"{len(other)} of {len(specs)} batches hold other sample sets: {other[:5]}"
    report = verify_run(r, open_store(str(store_dir)), RUN)
    assert report.ok and not report.missing_samples, report.lines()


def test_verify_names_an_object_of_another_incarnation(r, redis_server, tiny_model, tmp_path, rows):
    """An object whose bytes and ledger record agree, but whose header names another incarnation of the run."""
    store_dir = tmp_path / "store"
    run_pipeline(redis_server.url, tiny_model, str(store_dir), tmp_path / "spool", run=RUN, dataset=rows)
    incarnation = ledger.get_manifest(r, RUN).incarnation
    spec = ledger.all_specs(r, RUN)["b0000000"]
    path = store_dir / layout.batch_key(RUN, spec.shard, spec.batch_id)
    data = path.read_bytes()
    assert data.count(incarnation.encode()) == 1
    forged = data.replace(incarnation.encode(), b"0" * 32)   # same size: only the header's incarnation differs
    path.write_bytes(forged)
    info = {**ledger.done_info(r, RUN)["b0000000"], "sha256": hashlib.sha256(forged).hexdigest()}
    r.hset(RunKeys(RUN).done_chunk("b00000"), "00", doneledger.encode(info["size"], info["sha256"]))
    report = verify_run(r, open_store(str(store_dir)), RUN)
    assert not report.ok
    assert "not of this plan" in report.problems["b0000000"] and "incarnation 0000" in report.problems["b0000000"]
    assert list(report.problems) == ["b0000000"]
