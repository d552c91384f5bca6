"""A done ledger written by an older hsx, refused or converted to this hsx's (hsx/life/doneledger.py).

That ledger is three keys that grow with the run: the SET ``done``, the HASH ``done_info`` (batch id -> JSON
{size, sha256, ...}) and the HASH ``done_seq_pos`` (batch id -> its place in ``done_seq``). This hsx reads none of
them: every writer of the ledger and every whole-run reader refuses such a run in one line (``OldLedger``), which
says what to do: stop the older hsx's processes of the run, then run ``hsx produce`` for it once, whose resume
converts the ledger (``convert_old_ledger``, under the producer's lock) and goes on.

The conversion moves a thousand batches at a time, each thousand in one MULTI (their records written in the
chunks, taken out of the old keys), so a batch is in exactly one of the two ledgers at every moment, and a
conversion cut short is taken up where it stopped by the next ``hsx produce``; the counters, ``done_seq`` and the
logs are the same keys in both layouts and stay as they are.
"""

from __future__ import annotations

import json
import logging

import redis

from hsx.errors import HsxError
from hsx.life import doneledger
from hsx.life.keys import RunKeys
from hsx.redisconn import text

log = logging.getLogger(__name__)
CONVERT_CHUNK = 1000   # batches moved in one MULTI


class OldLedger(HsxError):
    """The run's done ledger is an older hsx's; the message says what to do."""


def old_ledger(r: redis.Redis, run: str) -> bool:
    """The run holds a key of the old ledger (one EXISTS)."""
    keys = RunKeys(run)
    return bool(r.exists(keys.done, keys.done_info, keys.done_seq_pos))


def why_old(run: str) -> str:
    return (f"run {run!r} has the done ledger of an older hsx (the set {RunKeys(run).done}); stop that "
            f"hsx's workers and uploaders of the run, then run `hsx produce` for it once with this hsx: it converts "
            "the ledger and resumes")


def refuse(r: redis.Redis, run: str) -> None:
    """OldLedger if the run's ledger is the old one."""
    if old_ledger(r, run):
        raise OldLedger(why_old(run))


def convert_old_ledger(r: redis.Redis, run: str) -> int:
    """Move the run's old ledger into the chunks; the number of done batches moved (0: nothing old). The caller
    holds the producer's lock; no process of the older hsx may write the run meanwhile."""
    keys = RunKeys(run)
    if not old_ledger(r, run):
        return 0
    done = sorted(text(b) for b in r.sscan_iter(keys.done, count=1000))
    moved = 0
    for start in range(0, len(done), CONVERT_CHUNK):
        bids = done[start:start + CONVERT_CHUNK]
        pipe = r.pipeline(transaction=False)
        pipe.hmget(keys.done_info, bids)
        pipe.hmget(keys.done_seq_pos, bids)
        infos, places = pipe.execute()
        pipe = r.pipeline(transaction=True)
        for bid, raw, place in zip(bids, infos, places, strict=True):
            chunk, field = doneledger.slot(bid)
            pipe.hset(keys.done_chunk(chunk), field, doneledger.encode(*_size_and_digest(run, bid, raw)))
            pipe.sadd(keys.done_chunks, chunk)
            if place is None:   # done by an hsx before the done sequence: its place now, as sequence_done gave it
                pipe.rpush(keys.done_seq, bid)
        pipe.srem(keys.done, *bids)
        pipe.hdel(keys.done_info, *bids)
        pipe.hdel(keys.done_seq_pos, *bids)
        pipe.execute()
        moved += len(bids)
    # Batches with a place that are not done (a repair took them out): an emptied record keeps their place.
    placed = [text(b) for b in r.hkeys(keys.done_seq_pos)]
    for start in range(0, len(placed), CONVERT_CHUNK):
        pipe = r.pipeline(transaction=True)
        for bid in placed[start:start + CONVERT_CHUNK]:
            chunk, field = doneledger.slot(bid)
            pipe.hsetnx(keys.done_chunk(chunk), field, "")
            pipe.sadd(keys.done_chunks, chunk)
        pipe.hdel(keys.done_seq_pos, *placed[start:start + CONVERT_CHUNK])
        pipe.execute()
    r.delete(keys.done, keys.done_info, keys.done_seq_pos)   # what is left: records of batches not done
    log.warning("run %s: converted the done ledger of an older hsx (%d done batches) to this hsx's", run,
                moved)
    return moved


def _size_and_digest(run: str, bid: str, raw) -> tuple[int, str]:
    try:
        info = json.loads(raw)
        size, sha256 = int(info["size"]), str(info["sha256"])
        bytes.fromhex(sha256)
        if len(sha256) == 64:
            return size, sha256
    except (TypeError, ValueError, KeyError, UnicodeDecodeError):
        pass
    raise OldLedger(f"run {run!r}: the old ledger's record of {bid} is not {{size, sha256}} ({text(raw or b'')[:80]!r});"
                    f" run `hsx verify --run {run} --repair` with the hsx that recorded it, then `hsx produce` again")
