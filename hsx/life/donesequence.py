"""The done sequence: the order in which a run's batches were recorded done, as a follower reads it.

``mark_done`` (hsx/life/ledger.py) appends a batch to ``done_seq`` in the script that records it done;
``sequence_done`` gives a place to the done batches that lack one (recorded by an hsx older than the
sequence, or by a ledger rebuilt from the store). A sequence has a generation, made once and lost with
the list, so a follower's cursor (a position in one sequence) is refused in another.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import redis

from hsx.life.keys import RunKeys
from hsx.life.ledger import done_ids
from hsx.redisconn import text

# KEYS: done, done_seq, done_seq_pos ; ARGV: the batch ids of done, sorted
# Appends, in the given order, the done batches done_seq lacks (recorded by an hsx older than done_seq, or
# by a rebuilt ledger). Idempotent; returns how many were appended.
_SEQUENCE_DONE = """
local added = 0
for _, bid in ipairs(ARGV) do
  if redis.call('SISMEMBER', KEYS[1], bid) == 1 and redis.call('HSETNX', KEYS[3], bid, redis.call('LLEN', KEYS[2])) == 1 then
    redis.call('RPUSH', KEYS[2], bid)
    added = added + 1
  end
end
return added
"""


def sequence_done(r: redis.Redis, run: str) -> int:
    """Give every done batch a place in ``done_seq`` (the ones without one, in batch-id order)."""
    keys = RunKeys(run)
    missing = sorted(done_ids(r, run) - {text(x) for x in r.hkeys(keys.done_seq_pos)})
    return int(r.eval(_SEQUENCE_DONE, 3, keys.done, keys.done_seq, keys.done_seq_pos, *missing)) if missing else 0


def sequence_generation(r: redis.Redis, run: str) -> str:
    """The id of this ``done_seq``: made once (the first caller sets it), lost with the list in a Redis loss, so
    a ledger rebuilt from the store (whose sequence is in another order) has another. A follower's cursor
    carries it: a position is only meaningful in the sequence it was counted in."""
    key = RunKeys(run).done_seq_generation
    r.set(key, uuid.uuid4().hex[:12], nx=True)
    return text(r.get(key))


@dataclass(frozen=True)
class SequenceWindow:
    """What a follower at ``position`` of ``done_seq`` checks, read in one round trip."""

    generation: str          # the sequence's generation now (made here if the key was lost)
    before: str | None       # batch id at position - 1 (None: position 0, or the list is shorter than that)
    at: str | None           # batch id at position (None: not recorded yet)
    length: int              # entries in done_seq now


def sequence_window(r: redis.Redis, run: str, position: int) -> SequenceWindow:
    """The generation, the batches at ``position - 1`` and ``position``, and the length of ``done_seq``, read
    atomically (MULTI), so a follower sees a rebuilt, reset or rolled-back sequence whenever it looks."""
    keys = RunKeys(run)
    pipe = r.pipeline(transaction=True)
    pipe.set(keys.done_seq_generation, uuid.uuid4().hex[:12], nx=True)
    pipe.get(keys.done_seq_generation)
    pipe.lindex(keys.done_seq, max(position - 1, 0))
    pipe.lindex(keys.done_seq, position)
    pipe.llen(keys.done_seq)
    _, generation, before, at, length = pipe.execute()
    return SequenceWindow(text(generation), text(before) if before is not None and position > 0 else None,
                          text(at) if at is not None else None, int(length))


def done_sequence(r: redis.Redis, run: str, start: int, count: int = 1000) -> list[str]:
    """Batch ids at positions ``start .. start + count - 1`` of ``done_seq`` (fewer at its end)."""
    return [text(x) for x in r.lrange(RunKeys(run).done_seq, start, start + count - 1)]


def sequence_length(r: redis.Redis, run: str) -> int:
    """Entries in ``done_seq`` now (one LLEN)."""
    return r.llen(RunKeys(run).done_seq)
