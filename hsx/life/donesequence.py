"""The done sequence: the order in which a run's batches were recorded done, as a follower reads it.

``mark_done`` (hsx/life/ledger.py) appends a batch to ``done_seq`` in the script that records it done (once:
a batch taken out and done again keeps its place, hsx/life/doneledger.py); ``sequence_done`` gives a place to
the done batches that lack one (the list lost while the ledger was not). A sequence has a generation, made once and lost with
the list, so a follower's cursor (a position in one sequence) is refused in another.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import redis

from hsx.life import doneledger
from hsx.life.keys import RunKeys
from hsx.life.ledger import done_count, done_ids
from hsx.redisconn import text

# KEYS: done prefix, done_seq ; ARGV: the length done_seq had when the missing ones were found, then their ids
# Appends, in the given order, the batches still done of those done_seq lacked, if done_seq is as long as when they
# were found (else -1, nothing written: something was appended meanwhile, the caller looks again). Returns how many.
_SEQUENCE_DONE = doneledger.LUA_DONE + """
if redis.call('LLEN', KEYS[2]) ~= tonumber(ARGV[1]) then return -1 end
local added = 0
for i = 2, #ARGV do
  if is_done(KEYS[1], ARGV[i]) then
    redis.call('RPUSH', KEYS[2], ARGV[i])
    added = added + 1
  end
end
return added
"""


def sequence_done(r: redis.Redis, run: str) -> int:
    """Give every done batch a place in ``done_seq`` (the ones without one, in batch-id order): the ones a Redis
    that lost the list but kept the ledger left without. O(1) when done_seq is at least as long as the ledger has
    done batches (every batch ``mark_done`` records gets its place in the same script); else O(run)."""
    keys = RunKeys(run)
    for _ in range(10):
        length = r.llen(keys.done_seq)
        if length >= done_count(r, run):
            return 0
        placed = {text(x) for x in r.lrange(keys.done_seq, 0, length - 1)}
        missing = sorted(done_ids(r, run) - placed)
        if not missing:
            return 0
        added = int(r.eval(_SEQUENCE_DONE, 2, keys.done_prefix, keys.done_seq, length, *missing))
        if added >= 0:
            return added
    raise RuntimeError(f"run {run!r}: done_seq kept growing while its missing batches were placed; try again")


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
