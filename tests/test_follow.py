"""Follow mode against a real running pipeline: a worker and an uploader run as processes while the test,
as a trainer would, reads the run through RunFollower; it starts before the run is complete, stops halfway
(a trainer crash), resumes from the saved cursor, and ends when the run is COMPLETE."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader

from hsx.life import donesequence, ledger
from hsx.life.keys import RunKeys
from hsx.redisconn import text
from hsx_reader import Cursor, ReaderError, RunDataset, RunFollower, collate_packed
from hsx_tools.demo import sample_dataset
from hsx_tools.processes import stop_all
from producer.produce import produce
from tests import followsampler
from tests.pacedworker import PACED_HSX
from tests.pipeline import planned_specs, produce_config, run_pipeline
from tests.waiting import scaled

RUN = "follow"


def _common(spool):
    return ["--spool-dir", str(spool), "--host", "followhost", "--heartbeat-seconds", "1"]


def _worker(env, spool, log, run=RUN):
    """A `--burst` worker of host followhost: it exits once the run's queue is drained."""
    return subprocess.Popen([*PACED_HSX, "worker", "--run", run, "--device", "cpu",
                             "--burst", *_common(spool)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _roles(env, spool, logs, run=RUN):
    uploader = subprocess.Popen([sys.executable, "-m", "hsx_cli.main", "upload", *_common(spool)], env=env,
                                stdout=open(logs / "upload.log", "w"), stderr=subprocess.STDOUT)
    return [_worker(env, spool, logs / "worker.log", run), uploader]


def _stop(procs):
    stop_all(procs)


@pytest.mark.slow
def test_trainer_follows_a_running_extraction_and_resumes_from_its_cursor(r, redis_server, tiny_model, tmp_path):
    store, rows = tmp_path / "store", tmp_path / "rows.jsonl"
    rows.write_text("".join(sample_dataset().read_text().splitlines(keepends=True)[:80]))   # about 29 batches
    report = produce(produce_config(redis_server.url, tiny_model, str(store), run=RUN, dataset=rows, token_budget=512,
                                    max_length=512, overlong="truncate"))
    assert report.batches >= 8
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "HSX_REDIS_URL": redis_server.url, "HSX_TEST_MIN_BATCH_SECONDS": "0.4"}
    procs = _roles(env, tmp_path / "spool", logs)
    try:
        # ---- trainer 1: starts with nothing done, reads about half the run, then "crashes"
        follower = RunFollower(redis_server.url, RUN, poll_seconds=0.05, timeout_seconds=120)
        assert follower.manifest.store.url == str(store)       # the store comes from the run's manifest
        loader = DataLoader(follower, batch_size=4, collate_fn=collate_packed)
        first, cursor, started = [], None, None
        for batch in loader:
            if started is None:   # the trainer's first step: the run is not complete yet
                started = (ledger.run_totals(r, RUN)["batches"], ledger.done_count(r, RUN))
                assert torch.isfinite(batch["hidden_states"]).all()
            first += batch["sample_ids"]
            cursor = batch["cursor"]
            if len(first) >= report.samples // 2:
                break
        assert started[1] < started[0], f"first step only after the run completed: {started}"
        seen_at = dict(follower.stats.seen_at)

        # ---- trainer 2: a new process would pass the saved cursor back
        resumed = RunFollower(redis_server.url, RUN, cursor=cursor, poll_seconds=0.05, timeout_seconds=120)
        rest = [s["sample_id"] for s in resumed]          # ends by itself once the run is COMPLETE
        assert resumed.complete()
        seen_at.update(resumed.stats.seen_at)
        procs[0].wait(timeout=scaled(60))    # the burst worker exits once its queue is drained
    finally:
        _stop(procs)
    assert procs[0].returncode == 0, (logs / "worker.log").read_text()[-2000:]

    # nothing repeated, nothing skipped, and in the ledger's order
    keys = RunKeys(RUN)
    sequence = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    specs = planned_specs(r, RUN)
    expected = [sid for bid in sequence for sid in specs[bid].sample_ids]
    assert first + rest == expected
    assert len(expected) == report.samples and sorted(sequence) == sorted(specs)

    # the same order again from the start (deterministic), and it matches the store's completed run
    again = [s["sample_id"] for s in RunFollower(redis_server.url, RUN, timeout_seconds=5)]
    assert again == expected
    complete = RunDataset(str(store), RUN)
    by_id = {s["sample_id"]: s for s in RunFollower(redis_server.url, RUN, cursor=Cursor(len(sequence) - 1, 0))}
    for sid, sample in by_id.items():
        assert torch.equal(sample["hidden_states"], complete.get(sid)["hidden_states"])

    # delay from "recorded done" (the uploader's done_log time) to the trainer decoding the batch
    done_at = {text(b): s for b, s in r.zrange(keys.done_log, 0, -1, withscores=True)}
    delays = [seen_at[b] - done_at[b] for b in seen_at if b in done_at and seen_at[b] >= done_at[b] - 0.05]
    waited = [d for d in delays if d >= 0]
    assert waited, (delays, seen_at, done_at)
    print(f"follow delay over {len(waited)} batches: median {statistics.median(waited) * 1000:.0f} ms, "
          f"max {max(waited) * 1000:.0f} ms (poll 50 ms)")
    assert max(waited) < 5.0


def test_cursor_is_checked_and_a_finished_run_ends(r, redis_server, tiny_model, tmp_path):
    run_pipeline(redis_server.url, tiny_model, str(tmp_path / "store"), tmp_path / "spool", run="fdone")
    with pytest.raises(ReaderError, match="POSITION:ROW"):
        RunFollower(redis_server.url, "fdone", cursor="7")
    n = sum(1 for _ in RunFollower(redis_server.url, "fdone", timeout_seconds=5))
    assert n == 160
    # a ledger whose done_seq was lost: the follower gives its batches a place, in batch-id order
    keys = RunKeys("fdone")
    r.delete(keys.done_seq)
    ids = [s["batch_id"] for s in RunFollower(redis_server.url, "fdone", timeout_seconds=5)]
    assert ids == sorted(ids) and len(ids) == 160
    # a cursor in the middle of a batch resumes at the next row of that batch
    sequence = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    pos = next(i for i, b in enumerate(sequence) if ledger.get_spec(r, "fdone", b).samples >= 3)
    tail = [s["sample_id"] for s in RunFollower(redis_server.url, "fdone", cursor=Cursor(pos, 2))]
    assert tail[0] == planned_specs(r, "fdone")[sequence[pos]].sample_ids[2]
    assert ledger.done_record(r, "fdone", sequence[0])["sha256"]


def test_a_cursor_counted_in_a_ledger_lost_with_redis_is_refused(r, redis_server, tiny_model, tmp_path):
    """After a Redis loss the ledger is rebuilt from the store and records its batches again in another order:
    a saved position would name other batches. The cursor carries its sequence's generation; a follower given
    a cursor of another generation refuses it in one line."""
    store = str(tmp_path / "store")
    run_pipeline(redis_server.url, tiny_model, store, tmp_path / "spool", run="fgen")
    stream = iter(RunFollower(redis_server.url, "fgen", timeout_seconds=5))
    saved = [next(stream) for _ in range(20)][-1]["cursor"]
    generation = donesequence.sequence_generation(r, "fgen")
    assert f"@{generation}/" in saved and Cursor.parse(saved).generation == generation
    assert [s["sample_id"] for s in RunFollower(redis_server.url, "fgen", cursor=saved)][:1]   # same ledger: goes on

    r.flushall()                                           # Redis restarted empty
    again = produce(produce_config(redis_server.url, tiny_model, store, run="fgen"))
    assert again.rebuilt == again.batches                  # the ledger rebuilt from the store, nothing recomputed
    with pytest.raises(ReaderError) as refused:
        RunFollower(redis_server.url, "fgen", cursor=saved)
    message = str(refused.value)
    assert "\n" not in message and saved in message and "start again from 0:0" in message, message
    assert donesequence.sequence_generation(r, "fgen") != generation
    # from the start of the new sequence: every sample once, cursors of the new generation
    samples = list(RunFollower(redis_server.url, "fgen", timeout_seconds=5))
    assert len({s["sample_id"] for s in samples}) == len(samples) == 160
    assert Cursor.parse(samples[-1]["cursor"]).generation == donesequence.sequence_generation(r, "fgen")
    # a cursor written before generations (POSITION:ROW) is taken as it is
    assert len(list(RunFollower(redis_server.url, "fgen", cursor="1:0", timeout_seconds=5))) < 160


def _follow_flags(model, layer_ids, run, save, log, data):
    """`speculators train` flags that follow ``run`` through its ledger (hsx_peers.speculators_follow)."""
    return ["--verifier-name-or-path", str(model), "--speculator-type", "eagle3", "--data-path", str(data),
            "--hidden-states-backend", "hsx", "--hsx-run", run, "--hsx-mode", "follow", "--hsx-follow-log", str(log),
            "--target-layer-ids", *[str(x + 1) for x in layer_ids], "--on-missing", "raise", "--epochs", "1",
            "--num-workers", "0", "--total-seq-len", "1024", "--checkpoint-freq", "0.25", "--save-path", str(save),
            "--lr", "1e-2", "--log-freq", "1", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--seed", "0"]


def _log(path):
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [x for x in lines if "step" in x], {x["read"]: x["at"] for x in lines if "read" in x}


def _caught_up(r, keys, log, trainer, first_position, timeout):
    """Wait until ``trainer`` (following, per ``log``, from ``first_position`` of done_seq) has taken every batch
    recorded done, and no more is being recorded (the worker is paused; the uploader has drained its spool)."""
    deadline, last, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline and trainer.poll() is None:
        n = r.llen(keys.done_seq)
        if n != last:
            last, since = n, time.monotonic()
        steps = _log(log)[0]
        wanted = steps[-1]["position"] + 1 if steps else first_position
        if wanted >= n and time.monotonic() - since > 2:
            return
        time.sleep(0.2)
    raise AssertionError(f"the trainer did not catch up with the ledger ({last} batches done)")


@pytest.mark.slow
def test_speculators_trainer_trains_while_extracting_and_resumes_from_its_checkpoint(r, redis_env, tmp_path,
                                                                                    tiny8_model):
    """speculators' own trainer (`speculators train`: its drafter, loss, optimizer, scheduler, checkpoints; the
    CPU device shim of tests/peers/train_speculators.py) follows a run being extracted by a worker and an
    uploader: its first step comes before the run is COMPLETE; killed after its first mid-epoch checkpoint, it
    is started again on the same --save-path and speculators' own resume goes on from that step: across both,
    every sample is trained on exactly once, in the ledger's order; the loss is finite and falls."""
    from tests.peerenv import SCRIPTS, peer_env, peer_python

    python = peer_python("speculators")
    model = tiny8_model
    # 1024-token run batches, one training step each
    report = produce(produce_config(redis_env, model, str(tmp_path / "store"), run="fspec", layers="eagle3",
                                    token_budget=1024))
    layer_ids = list(ledger.get_manifest(r, "fspec").layer_ids)
    save, data, logs, keys = tmp_path / "ckpt", tmp_path / "spec-data", tmp_path / "logs", RunKeys("fspec")
    data.mkdir()
    logs.mkdir()

    def trainer(name):
        flags = _follow_flags(model, layer_ids, "fspec", save, tmp_path / f"{name}.jsonl", data)
        return subprocess.Popen([str(python), str(SCRIPTS / "train_speculators.py"), json.dumps([flags])], cwd=tmp_path,
                                env=peer_env(), stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)

    first_trainer = trainer("first")
    procs = [first_trainer]
    try:
        procs += _roles({**os.environ, "HSX_TEST_MIN_BATCH_SECONDS": "3"}, tmp_path / "spool", logs, run="fspec")
        worker = procs[1]
        state = save / "0" / "training_state.json"
        deadline = time.monotonic() + scaled(300)
        while not state.exists() and first_trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first_trainer.kill()                                    # dies after its first mid-epoch checkpoint
        first_trainer.wait(timeout=scaled(30))
        assert state.exists(), (logs / "first.log").read_text()[-4000:]
        checkpoint_step = json.loads(state.read_text())["local_step"]
        assert ledger.done_count(r, keys.run) < report.batches, "extraction ended before the checkpoint"
        # the same command again: speculators' resume asks the sampler for the steps from the checkpoint on
        second_trainer = trainer("second")
        procs.append(second_trainer)
        # three times: pause the "GPU" until the trainer has caught up, so it waits for the next batch (what the
        # delay from "recorded done" to "decoded" is measured on); then let extraction go on
        for _ in range(3):
            if worker.poll() is not None:
                break
            worker.send_signal(signal.SIGSTOP)
            try:
                # one run batch a step here: the trainer resumes at position checkpoint_step of done_seq
                _caught_up(r, keys, tmp_path / "second.jsonl", second_trainer, checkpoint_step, timeout=scaled(300))
                time.sleep(5)                                   # the last step is trained; the sampler waits
            finally:
                worker.send_signal(signal.SIGCONT)
            done = r.llen(keys.done_seq)
            while r.llen(keys.done_seq) == done and worker.poll() is None:
                time.sleep(0.1)
        # the pauses are over: a second worker extracts the rest at the CPU's pace beside the paced one (over half
        # the run was left here, 3 s a batch), and the trainer trains that tail from its backlog
        procs.append(_worker(os.environ, tmp_path / "spool", logs / "worker-unpaced.log", run="fspec"))
        assert second_trainer.wait(timeout=scaled(600)) == 0, (logs / "second.log").read_text()[-4000:]
        assert worker.wait(timeout=scaled(120)) == 0, (logs / "worker.log").read_text()[-2000:]
        assert procs[-1].wait(timeout=scaled(120)) == 0, (logs / "worker-unpaced.log").read_text()[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        stop_all(procs)
    second = json.loads((logs / "second.log").read_text().strip().splitlines()[-1])
    first, first_reads = _log(tmp_path / "first.jsonl")
    rest, rest_reads = _log(tmp_path / "second.jsonl")
    done_at = {text(b): s for b, s in r.zrange(keys.done_log, 0, -1, withscores=True)}
    complete_at = max(done_at.values())
    assert ledger.done_count(r, keys.run) == report.batches
    # the first step came before the run was COMPLETE
    assert first[0]["step"] == 0 and first[0]["at"] < complete_at, (first[0], complete_at)
    # speculators' checkpoint recorded step k; the second trainer went on from step k: each sample exactly once
    assert checkpoint_step > 0 and rest[0]["step"] == checkpoint_step
    trained = [s for x in first if x["step"] < checkpoint_step for s in x["sample_ids"]]
    trained += [s for x in rest for s in x["sample_ids"]]
    sequence = [text(b) for b in r.lrange(keys.done_seq, 0, -1)]
    specs = planned_specs(r, "fspec")
    assert trained == [sid for bid in sequence for sid in specs[bid].sample_ids]
    assert len(trained) == len(set(trained)) == report.samples
    # speculators' own loop trained every step of the second trainer; the loss is finite and falls
    losses = second["losses"][0]
    assert len(losses) == len(rest) == report.batches - checkpoint_step, (len(losses), len(rest))
    assert all(math.isfinite(x) for x in losses)
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]), losses
    # delay from "recorded done" to the trainer decoding the object: for the batches the trainer waited for (it
    # had trained on everything before), the follow path's own; for the others, the backlog of a slower trainer
    waited, backlog = [], []
    for steps, reads in ((first, first_reads), (rest, rest_reads)):
        for x in steps:
            if x["batch_id"] in reads:
                (waited if x["waited"] > 0 else backlog).append(reads[x["batch_id"]] - done_at[x["batch_id"]])
    assert len(waited) >= 3 and statistics.median(waited) < 2.0, waited
    # a trainer that kept up with extraction has no backlog: every batch it read was one it waited for
    backlog_text = f"median {statistics.median(backlog):.1f} s" if backlog else "the trainer kept up"
    print(f"\nspeculators train following a run: first step {complete_at - first[0]['at']:.1f} s before COMPLETE "
          f"({report.batches} batches); checkpoint at step {checkpoint_step}, resumed there; {len(trained)} samples "
          f"once each; loss {losses[0]:.4f} -> {losses[-1]:.4f} over the {len(losses)} steps after the restart; "
          f"done -> decoded, {len(waited)} batches the trainer waited for: median "
          f"{statistics.median(waited) * 1000:.0f} ms, max {max(waited) * 1000:.0f} ms (poll 200 ms); "
          f"{len(backlog)} batches of backlog: {backlog_text}")




@pytest.mark.slow
def test_follow_sampler_packs_long_batches_and_refuses_a_resume_on_a_rebuilt_ledger(r, redis_server, tiny_model,
                                                                                    tmp_path):
    """speculators' follow sampler (in its venv): run batches over --total-seq-len tokens are cut into steps of at
    most that many (a longer sample alone), every sample once in the ledger's order; resuming at step k gives the
    same steps from k on; after the ledger was rebuilt from the store, a resume is refused in one line."""
    from tests.peerenv import peer_env, peer_python

    store = str(tmp_path / "store")
    run_pipeline(redis_server.url, tiny_model, store, tmp_path / "spool", run="fpack")   # 1024-token batches
    python, state = peer_python("speculators"), tmp_path / "ckpt"

    def sampler(start):
        out = subprocess.run([str(python), "-c", followsampler.SCRIPT, redis_server.url, "fpack", str(state), str(start)],
                             env=peer_env(tmp_path), capture_output=True, text=True, timeout=scaled(300))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    got = sampler(0)
    lengths = {}
    for s in RunDataset(store, "fpack"):
        lengths[s["sample_id"]] = len(s["input_ids"])
    specs = planned_specs(r, "fpack")
    sequence = [text(b) for b in r.lrange(RunKeys("fpack").done_seq, 0, -1)]
    steps = [[specs[bid].sample_ids[row] for bid, row in step] for step in got["steps"]]
    assert [sid for step in steps for sid in step] == [sid for bid in sequence for sid in specs[bid].sample_ids]
    assert all(len({bid for bid, _ in step}) == 1 for step in got["steps"])         # a step within one run batch
    assert all(sum(lengths[s] for s in step) <= 256 or len(step) == 1 for step in steps)
    assert len(steps) > len(sequence) and got["length"] <= len(steps)               # long batches were cut
    assert json.loads((state / "hsx_follow.json").read_text())["total_seq_len"] == 256
    assert sampler(5)["steps"] == got["steps"][5:]                                  # resume: the same steps

    r.flushall()                                           # Redis lost; the ledger rebuilt from the store
    produce(produce_config(redis_server.url, tiny_model, store, run="fpack"))
    refused = sampler(5)["refused"]
    assert "\n" not in refused and "rebuilt" in refused and str(state) in refused, refused
