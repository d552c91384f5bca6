"""Train while extracting with speculators' own trainer: its data loader follows an hsx run through the ledger.

``HSX_REDIS_URL=redis://... python -m hsx_peers.speculators train --hidden-states-backend hsx --hsx-run R --hsx-mode follow``
is ``speculators train`` (its config, vocabulary, drafter, ``Trainer``, loss, optimizer, scheduler and
checkpoints) with one part swapped: the loader. speculators 0.9.0 builds its ``ArrowDataset`` (fixed length,
sized when training starts) inside ``speculators.train.cli.create_train_val_loaders`` and has no hook for
another dataset, so ``install()`` wraps that one function: with ``--hsx-mode follow`` it returns the loader below
(and no validation loader), otherwise speculators' own. The ledger's Redis comes from ``HSX_REDIS_URL`` (or
``REDIS_URL``, + ``HSX_REDIS_PASSWORD``) as for every hsx process, never a flag: speculators writes its flags
into the checkpoint folder (``run.yaml``).

- ``FollowSampler`` (the loader's batch sampler, in the trainer's process) walks the ledger's ``done_seq``
  with ``hsx_reader.RunFollower``, waiting for the next batch to be recorded done, and packs the samples of
  each run batch into training steps of at most ``--total-seq-len`` tokens (a step never spans two run
  batches, so a step waits for one batch only). The order is the ledger's: the same on every restart.
- ``FollowDataset`` (speculators' ``BaseDataset``) reads each run batch's object whole, checks it against
  the size and SHA-256 the ledger recorded, and gives each sample in speculators' layout (as the ``hsx``
  backend does for a completed run); speculators' own ``CollateFn`` (with its EAGLE-3 shift) packs a step.
- Resume is speculators' own: a mid-epoch checkpoint (``--checkpoint-freq`` < 1) records its step, and on
  restart (same ``--save-path``) its ``Trainer`` asks the sampler for the steps from there on
  (``_generate_batches(epoch)[step:]``, the protocol of its own sampler). Steps are a function of the
  ledger's sequence and ``--total-seq-len``, so step k names the same samples after a restart: the sampler
  walks the sequence to step k (Redis reads; a run batch over ``--total-seq-len`` tokens also costs a range
  read of its ``cu_seqlens``) and goes on from there, none repeated, none skipped. ``<save-path>/hsx_follow.json``
  records the run, the sequence's generation and the step size; a resume against a ledger rebuilt since (a
  Redis loss: another order) or another step size is refused in one line. ``<save-path>/hsx_follow_seq.txt``
  lists the run batch at each position the sampler handed out (a line each): a resume checks the positions
  it walks against it, so a ledger rolled back a few seconds (same generation, its tail recorded again in
  another order) is refused too. While it follows, every look at the ledger checks the generation and that
  the batch before is still in its place (``RunFollower.next_batch_id``), so a rebuild, reset or rollback under
  a running trainer is refused, never trained through.
- ``--hsx-on-dead-letter wait|skip|stop``: what the sampler does when only dead letters are left (it logs what
  it waits for, every minute, in any case): wait for ``hsx retry-failed``, end the epoch without them, or stop.
- The epoch ends when the run is COMPLETE and every done batch was trained on. Its length (for speculators'
  LR schedule and progress bar) is counted from the plan once the producer has planned every batch: exact when
  every run batch fits one step (extract with ``--token-budget`` <= ``--total-seq-len``), else
  ceil(tokens / total-seq-len) a batch, a lower bound.

One process (no ``torchrun``: ranks would get different step counts); ``--num-workers`` works (the sampler
stays in the trainer's process, workers read objects). ``--hsx-follow-log PATH`` appends a JSON line per step
(step, batch id, sample ids, cursor, when the sampler took it, how long it waited for the ledger) and per object
read (when it was decoded).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from hs_connectors import HiddenStatesTransfer
from speculators.train.data import BaseDataset, CollateFn
from speculators.train.distributed import get_dp_size
from torch.utils.data import DataLoader

from hsx import life
from hsx.store import StoreSettings, layout
from hsx_reader import Cursor, ReaderError, RunFollower
from hsx_reader.objects import fetch_header, fetch_rows

STATE_FILE = "hsx_follow.json"     # beside speculators' checkpoints: what a resumed sampler must match
SEQUENCE_FILE = "hsx_follow_seq.txt"   # beside them: the run batch at each position handed out, a line each
PLAN_POLL_SECONDS = 1.0            # how often the plan is looked at while the producer is still planning


class SampleAt(NamedTuple):
    """What the sampler hands the dataset: row ``row`` of run batch ``batch_id``."""

    batch_id: str
    row: int


class FollowTransfer(HiddenStatesTransfer):
    """The ``hsx`` backend in follow mode (``--hsx-mode follow``): settings only; the follow loader reads the run, not speculators'
    ``ArrowDataset``, so nothing is asked of it by index."""

    def __init__(self, redis_url: str, run: str, store: StoreSettings | None, save_path: str, log_path: str | None,
                 on_dead_letter: str = "wait"):
        self.redis_url, self.run, self.store, self.save_path, self.log_path = redis_url, run, store, save_path, log_path
        self.on_dead_letter = on_dead_letter

    def follower(self) -> RunFollower:
        return RunFollower(self.redis_url, self.run, store=self.store, on_dead_letter=self.on_dead_letter)

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        raise ReaderError("the hsx backend in follow mode (--hsx-mode follow) reads through its own loader, not by index")

    def get_generated(self, hs_transfer_params: dict) -> dict[str, torch.Tensor] | None:
        return None


class FollowLog:
    """JSON lines appended to ``path`` (one write each, so worker processes may share it); None: nothing."""

    def __init__(self, path: str | None):
        self.path = path

    def write(self, **record) -> None:
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record, separators=(",", ":")) + "\n")


class FollowSteps:
    """The steps of one epoch from ``start`` on; slicing ``[k:]`` (all speculators' resume does) moves it."""

    def __init__(self, sampler: FollowSampler, start: int = 0):
        self.sampler, self.start = sampler, start

    def __getitem__(self, index: slice) -> FollowSteps:
        if not isinstance(index, slice) or index.stop is not None or index.step not in (None, 1):
            raise TypeError("the steps of a followed run can only be sliced as [k:]")
        return FollowSteps(self.sampler, self.start + (index.start or 0))

    def __iter__(self):
        return self.sampler.steps(self.start)


class FollowSampler:
    """speculators' batch sampler for a followed run: lists of ``SampleAt``, one list a training step."""

    def __init__(self, follower: RunFollower, total_seq_len: int, state_dir: str, log: FollowLog):
        self.follower, self.total_seq_len, self.state_dir, self.log = follower, total_seq_len, Path(state_dir), log
        self.epoch = 0
        self._length: int | None = None
        self._cached_generated_batches: tuple[int, FollowSteps | None] = (-1, None)   # speculators' resume protocol

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _generate_batches(self, epoch: int) -> FollowSteps:
        return FollowSteps(self)

    def __iter__(self):
        epoch, steps = self._cached_generated_batches
        self._cached_generated_batches = (-1, None)
        return iter(steps if epoch == self.epoch and steps is not None else FollowSteps(self))

    def __len__(self) -> int:
        """Steps of the whole run, from the plan (waits while the producer is still planning)."""
        if self._length is None:
            run = life.Run(self.follower.r, self.follower.run)
            while run.planning_in_progress():
                time.sleep(PLAN_POLL_SECONDS)
            specs = run.all_specs().values()
            self._length = sum(max(1, math.ceil(s.tokens / self.total_seq_len)) for s in specs)
        return self._length

    def _rows_per_step(self, spec: life.BatchSpec) -> list[range]:
        """The batch's rows cut into steps: greedy, in row order, at most total_seq_len tokens a step (a longer
        sample is a step of its own; speculators' collate truncates it)."""
        if spec.tokens <= self.total_seq_len:
            return [range(spec.samples)]
        store = self.follower.store
        header = fetch_header(store, layout.batch_key(self.follower.run, spec.shard, spec.batch_id))
        if "cu_seqlens" in header.encoding:     # compressed: no range read; the whole object, digest-checked
            cu = self.follower.read_batch(spec.batch_id)[2].cu_seqlens.tolist()
        else:
            cu = fetch_rows(store, header, ["cu_seqlens"], 0, spec.samples + 1)["cu_seqlens"].tolist()
        steps, first = [], 0
        for row in range(spec.samples):
            if row > first and cu[row + 1] - cu[first] > self.total_seq_len:   # row does not fit: a new step
                steps.append(range(first, row))
                first = row
        steps.append(range(first, spec.samples))
        return steps

    def _check_state(self, start: int, generation: str) -> None:
        """Write what the steps depend on beside the checkpoints; a resume (start > 0) must match it."""
        state = {"run": self.follower.run, "generation": generation, "total_seq_len": self.total_seq_len}
        path = self.state_dir / STATE_FILE
        if start > 0:
            saved = json.loads(path.read_text()) if path.exists() else None
            if saved is None:
                raise ReaderError(f"resuming speculators' checkpoint at step {start} in {self.state_dir}, which has "
                                  f"no {STATE_FILE}: it was not trained by following run {self.follower.run!r}")
            if saved != state:
                raise ReaderError(f"the checkpoint in {self.state_dir} was trained following {saved}, now it would be "
                                  f"{state}: its step {start} names other samples (ledger rebuilt after a Redis "
                                  "loss, or another --total-seq-len); train again from scratch (a new --save-path)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{STATE_FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    def _handed_out(self, start: int) -> list[str]:
        """The run batches at the positions handed out before (a resume), from SEQUENCE_FILE; [] from scratch."""
        path = self.state_dir / SEQUENCE_FILE
        if start == 0 or not path.exists():
            return []
        return path.read_text().split()

    def _record(self, position: int, bid: str) -> None:
        """Note the run batch at ``position`` in SEQUENCE_FILE (which then holds positions 0..position)."""
        path = self.state_dir / SEQUENCE_FILE
        if position == 0:
            path.write_text(bid + "\n")
        else:
            with open(path, "a") as fh:
                fh.write(bid + "\n")

    def steps(self, start: int):
        follower = self.follower
        generation = follower.generation()
        self._check_state(start, generation)
        handed_out = self._handed_out(start)
        life.Run(follower.r, follower.run).sequence_done()
        step, position, previous, recording, walked = 0, 0, "", start == 0, []
        while True:
            waited = follower.stats.waited_seconds
            bid = follower.next_batch_id(position, generation, previous)
            if bid is None:
                return
            waited = follower.stats.waited_seconds - waited    # > 0: the trainer waited for this batch to be done
            spec = follower.spec_with_ids(bid)   # its sample ids: the step log names them
            cut = self._rows_per_step(spec)
            if not recording and step + len(cut) > start:     # this position's steps reach the resumed ones
                recording = True
                (self.state_dir / SEQUENCE_FILE).write_text("".join(b + "\n" for b in walked))   # checked below
            if step < start and position < len(handed_out) and handed_out[position] != bid:
                raise ReaderError(f"resuming at step {start} in {self.state_dir}: position {position} of run "
                                  f"{follower.run!r}'s done sequence held batch {handed_out[position]} when it was "
                                  f"trained on, and now holds {bid}: Redis lost its latest writes (rolled back), so "
                                  f"step {start} names other samples; train again from scratch (a new --save-path)")
            if recording:
                self._record(position, bid)
            else:
                walked.append(bid)
            previous = bid
            for rows in cut:
                if step >= start:
                    last = rows[-1] + 1
                    after = (Cursor(position + 1, 0, generation, bid) if last == spec.samples
                             else Cursor(position, last, generation, bid))
                    self.log.write(step=step, epoch=self.epoch, batch_id=bid, position=position, waited=round(waited, 3),
                                   sample_ids=[spec.sample_ids[i] for i in rows], cursor=str(after), at=time.time())
                    yield [SampleAt(bid, row) for row in rows]
                step += 1
            position += 1


class FollowDataset(BaseDataset):
    """Samples of a followed run in speculators' layout: ``hidden_states`` [T, n*H] (the run's layers),
    ``verifier_last_hidden_states`` [T, H] (the final state / the target's final-norm gain, as the export and
    the ``hsx`` backend give it; speculators applies the norm), ``input_ids``, ``loss_mask``."""

    def __init__(self, follower: RunFollower, hidden_states_dtype: torch.dtype, log: FollowLog):
        manifest = follower.manifest
        if not manifest.store_final:
            raise ReaderError(f"run {follower.run!r} stores no final hidden state; speculators reads it as its last "
                              "slot: extract with a layer spec ending in +final (e.g. --layers eagle3 or dflash:5+final)")
        self.follower, self.log, self.hidden_size = follower, log, manifest.hidden_size
        self._batch = None     # (batch id, spec, where, contents) of the last object read
        self._gain = None
        super().__init__(max_len=0, hidden_states_dtype=hidden_states_dtype)

    def _compute_approx_lengths(self) -> list[int]:
        return []   # packing is the sampler's, from the run's own batches

    def __getstate__(self):
        return {**self.__dict__, "_batch": None}

    def _get_raw_data(self, at: SampleAt) -> dict[str, torch.Tensor]:
        from hsx_tools.export import final_norm_gain, speculators_record

        if self._batch is None or self._batch[0] != at.batch_id:
            spec, where, contents = self.follower.read_batch(at.batch_id)
            self._batch = (at.batch_id, spec, where, contents)
            self.log.write(read=at.batch_id, at=time.time())
        _, spec, where, contents = self._batch
        if self._gain is None:
            self._gain = final_norm_gain(self.follower.manifest.model, self.hidden_size)
        record = speculators_record(self.follower.sample(spec, where, contents, at.row), self.hidden_size, self._gain)
        stacked = record["hidden_states"]
        return {"hidden_states": stacked[:, :-1].flatten(1), "input_ids": record["token_ids"],
                "verifier_last_hidden_states": stacked[:, -1], "loss_mask": record["loss_mask"]}


def follow_loader(transfer: FollowTransfer, *, total_seq_len: int, hidden_states_dtype: torch.dtype, hidden_size: int,
                  num_target_layers: int, num_workers: int, prefetch_factor: int, preprocess) -> DataLoader:
    if get_dp_size() > 1:
        raise ReaderError("following a run trains in one process: its ranks would get different numbers of steps "
                          "(run without torchrun, or train on the completed run)")
    follower, log = transfer.follower(), FollowLog(transfer.log_path)
    use_workers = num_workers > 0
    return DataLoader(
        FollowDataset(follower, hidden_states_dtype, log),
        batch_sampler=FollowSampler(follower, total_seq_len, transfer.save_path, log),
        num_workers=num_workers, prefetch_factor=prefetch_factor if use_workers else None, pin_memory=True,
        collate_fn=CollateFn(total_seq_len, hidden_size, num_target_layers=num_target_layers, dtype=hidden_states_dtype,
                             preprocess=preprocess),
        persistent_workers=use_workers, multiprocessing_context="spawn" if use_workers else None)


def install() -> None:
    """Wrap speculators' loader factory: the follow loader for the hsx backend with --hsx-mode follow."""
    import speculators.train.cli as cli

    own = cli.create_train_val_loaders
    if getattr(own, "hsx_follow", False):
        return

    def create_train_val_loaders(**kwargs):
        transfer = kwargs.get("transfer")
        if not isinstance(transfer, FollowTransfer):
            return own(**kwargs)
        loader = follow_loader(transfer, **{k: kwargs[k] for k in (
            "total_seq_len", "hidden_states_dtype", "hidden_size", "num_target_layers", "num_workers",
            "prefetch_factor", "preprocess")})
        return loader, None

    create_train_val_loaders.hsx_follow = True
    cli.create_train_val_loaders = create_train_val_loaders
