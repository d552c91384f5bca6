"""The done ledger's layout in Redis: one small hash per hundred batches, whatever the run's size.

A batch id splits into a chunk and a field, its last two characters (``b0001234`` -> chunk ``b00012``, field
``34``; an id of two characters or fewer: chunk ``""``, field the id), and its record lives at field ``field`` of
the HASH ``hsx:<run>:done:<chunk>``. A chunk holds at most 100 canonical batches, under Redis' listpack limits
(hash-max-listpack-entries 128, hash-max-listpack-value 64), so Redis keeps it as one compact listpack: ~45 bytes
a batch, where the SET ``done`` + the JSON HASH ``done_info`` + the HASH ``done_seq_pos`` of an hsx before issue
42 took ~300.

A record (a field's value) is one of:

- ``<32 bytes: the object's SHA-256> <its size in decimal ASCII>`` (no separator): the batch is done, its object
  verified in the store with that size and digest;
- ``""`` (empty): the batch was done once and taken out again (``verify --repair``: its object went bad); it keeps
  its place in ``done_seq``, so it is not appended a second time when it is done again.

A field absent: never done. The chunks a run has written are named in the SET ``done_chunks`` (what a whole-run
read walks; one member a hundred batches). The Lua of every script that asks "is this batch done?" is
``LUA_DONE`` here: ``is_done(prefix, bid)`` where ``prefix`` is ``RunKeys.done_prefix``.

A run recorded by an older hsx (its ``done`` SET, ``done_info`` and ``done_seq_pos``) is read by
nothing here: the producer converts it (hsx/life/oldledger.py), every other reader and writer refuses it.
"""

from __future__ import annotations

from collections import defaultdict

import redis

from hsx.life.keys import RunKeys
from hsx.redisconn import text

DIGEST_BYTES = 32   # a record's SHA-256, raw, before the size

# is_done(prefix, bid): the batch's record is there and not emptied. done_slot(prefix, bid): its hash and field.
LUA_DONE = """
local function done_slot(prefix, bid)
  if #bid > 2 then return prefix .. string.sub(bid, 1, -3), string.sub(bid, -2) end
  return prefix, bid
end
local function is_done(prefix, bid)
  local key, field = done_slot(prefix, bid)
  return redis.call('HSTRLEN', key, field) > 0
end
"""


def slot(bid: str) -> tuple[str, str]:
    """(chunk, field) of a batch id, as ``done_slot`` in LUA_DONE splits it."""
    return (bid[:-2], bid[-2:]) if len(bid) > 2 else ("", bid)


def encode(size: int, sha256: str) -> bytes:
    """A done record: the raw digest, then the size in decimal."""
    return bytes.fromhex(sha256) + str(int(size)).encode()


def decode(raw: bytes | None) -> dict | None:
    """A done record as ``{"size", "sha256"}``; None for none, an emptied one, or one this hsx does not write
    (too short, a size that is not digits): a reader treats such a batch as not done."""
    if not raw or len(raw) <= DIGEST_BYTES or not raw[DIGEST_BYTES:].isdigit():
        return None
    return {"size": int(raw[DIGEST_BYTES:]), "sha256": raw[:DIGEST_BYTES].hex()}


def _by_chunk(bids) -> dict[str, list[tuple[str, str]]]:
    chunks: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for bid in bids:
        chunk, field = slot(bid)
        chunks[chunk].append((bid, field))
    return chunks


def records_of(r: redis.Redis, run: str, bids) -> dict[str, bytes | None]:
    """The raw records of ``bids`` (None: no field), one HMGET a chunk, in one pipeline."""
    keys, chunks = RunKeys(run), _by_chunk(bids)
    if not chunks:
        return {}
    pipe = r.pipeline(transaction=False)
    for chunk, members in chunks.items():
        pipe.hmget(keys.done_chunk(chunk), [field for _, field in members])
    out = {}
    for members, values in zip(chunks.values(), pipe.execute(), strict=True):
        out.update((bid, value) for (bid, _), value in zip(members, values, strict=True))
    return out


def done_among(r: redis.Redis, run: str, bids) -> set[str]:
    """Those of ``bids`` the ledger holds done."""
    return {bid for bid, raw in records_of(r, run, bids).items() if raw}


def done_record(r: redis.Redis, run: str, bid: str) -> dict | None:
    """The ledger's record of ``bid`` ({size, sha256}); None while it is not done."""
    chunk, field = slot(bid)
    return decode(r.hget(RunKeys(run).done_chunk(chunk), field))


def all_records(r: redis.Redis, run: str) -> dict[str, bytes]:
    """Every field of every chunk, raw (emptied ones included): O(run), for whole-run readers (verify, the index,
    resume). One HGETALL a chunk, pipelined a thousand chunks at a time."""
    keys = RunKeys(run)
    chunks = sorted(text(c) for c in r.smembers(keys.done_chunks))
    out: dict[str, bytes] = {}
    for start in range(0, len(chunks), 1000):
        part = chunks[start:start + 1000]
        pipe = r.pipeline(transaction=False)
        for chunk in part:
            pipe.hgetall(keys.done_chunk(chunk))
        for chunk, fields in zip(part, pipe.execute(), strict=True):
            out.update((chunk + text(f), v) for f, v in fields.items())
    return out


def done_ids(r: redis.Redis, run: str) -> set[str]:
    return {bid for bid, raw in all_records(r, run).items() if raw}


def done_info(r: redis.Redis, run: str) -> dict[str, dict]:
    """Batch id -> {size, sha256} of every done batch (a record this hsx does not write is left out)."""
    return {bid: info for bid, raw in all_records(r, run).items() if (info := decode(raw)) is not None}


def done_count(r: redis.Redis, run: str) -> int:
    """Batches done: the counter ``mark_done`` and ``unmark_done`` move in the script that records them (O(1))."""
    return int(r.hget(RunKeys(run).counters, "batches") or 0)
