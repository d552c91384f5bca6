"""Follow a run while it is extracted: samples of each batch as the ledger records it done, until COMPLETE.

The ledger, not the store listing, says which batches exist: the follower
reads the run's ``done_seq`` (a Redis LIST the uploader appends a batch id to
when it first records the batch done, see ``hsx.run.ledger.mark_done``), fetches
each batch object whole, checks it against the size and SHA-256 the ledger
recorded (``done_info``), and yields its samples in row order. The order is
the ledger's, the same for every reader and every restart; a batch repaired
(taken out of the ledger and recorded again) keeps its place, and the
follower waits at that place until it is done again.

Resuming: every sample carries ``cursor``, a string naming the place just
after it (``POSITION:ROW@GENERATION``). A trainer saves the cursor of the last sample it trained on (the
collate functions pass the last one on as ``batch["cursor"]``) and, after a
restart, passes it back: the stream goes on with the next sample, none
repeated, none skipped. With ``world_size`` ranks, rank r reads the batches
at positions r, r + world_size, ... of the sequence (one cursor per rank).
One reader per rank: use ``num_workers`` 0 or 1 in a DataLoader.

A position means something only in the sequence it was counted in. A ledger
rebuilt from the store after a Redis loss records its batches again in another
order, under a new ``done_seq_generation`` (``hsx.ledger.sequence_generation``);
a cursor carries the generation it was counted in, and a follower given a
cursor of another generation refuses it (ReaderError, one line) instead of
resuming at a place that names other batches. A cursor without a generation
(``POSITION:ROW``, written before generations) is taken as it is.

The iteration ends when the run is COMPLETE (every planned batch done, the
producer done planning) and every done batch was read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis
from torch.utils.data import IterableDataset, get_worker_info

from hsx.config import StoreSettings
from hsx.redisconn import text
from hsx.run import ledger
from hsx.run.keys import RunKeys
from hsx.store import Store, layout
from hsx_reader.objects import BatchContents, check_digest, decode, fetch_object
from hsx_reader.run import Expectations, ReaderError, SampleRef
from hsx_reader.source import sample_of
from hsx_reader.stream import _rank_world

POLL_SECONDS = 0.2      # how often the ledger is asked for new batches when none is waiting
SEQUENCE_READ = 256     # batch ids read from done_seq per request


@dataclass(frozen=True)
class Cursor:
    """A place in the followed stream: batch ``position`` of the ledger's sequence, ``row`` samples of it read."""

    position: int = 0
    row: int = 0
    generation: str = ""     # the done_seq the position was counted in ("": not known, not checked)

    def __str__(self) -> str:
        return f"{self.position}:{self.row}" + (f"@{self.generation}" if self.generation else "")

    @classmethod
    def parse(cls, value: str | Cursor | None) -> Cursor:
        if value is None:
            return cls()
        if isinstance(value, Cursor):
            return value
        place, _, generation = str(value).partition("@")
        try:
            position, row = (int(x) for x in place.split(":"))
        except ValueError:
            raise ReaderError(f"cursor {value!r} is not POSITION:ROW[@GENERATION] (the 'cursor' of a sample)") from None
        if position < 0 or row < 0:
            raise ReaderError(f"cursor {value!r} has a negative part")
        return cls(position, row, generation)


@dataclass
class FollowStats:
    batches: int = 0
    samples: int = 0
    bytes_read: int = 0                     # bytes fetched from the store (whole objects)
    waited_seconds: float = 0.0             # time spent waiting for the ledger to record a batch
    seen_at: dict[str, float] = field(default_factory=dict)   # batch id -> unix time its object was decoded


class RunFollower(IterableDataset):
    def __init__(self, redis_client: redis.Redis | str, run: str, store: Store | StoreSettings | str | None = None,
                 expect: Expectations | None = None, cursor: str | Cursor | None = None,
                 poll_seconds: float = POLL_SECONDS, timeout_seconds: float | None = None, verify: bool = True,
                 rank: int | None = None, world_size: int | None = None):
        """``redis_client``: a client or URL of the Redis holding the run's ledger. ``store``: defaults to the
        one the run's manifest recorded. ``timeout_seconds``: raise ReaderError if no batch is recorded done
        for that long (None: wait as long as the run is not complete)."""
        self.redis_url = redis_client if isinstance(redis_client, str) else None
        self._r = None if isinstance(redis_client, str) else redis_client
        self.run = layout.check_run_name(run)
        self.manifest = ledger.require_manifest(self.r, run)
        (expect or Expectations()).check(self.manifest, run)
        if store is None:
            store = self.manifest.store
        self.settings = StoreSettings(url=store) if isinstance(store, str) else store
        self._store = store if isinstance(store, Store) else None
        self.cursor = Cursor.parse(cursor)
        if self.cursor.generation:
            self.generation()   # a cursor of a lost ledger is refused here, not at the first batch
        self.poll_seconds, self.timeout_seconds, self.verify = poll_seconds, timeout_seconds, verify
        self.rank, self.world_size = rank, world_size
        self.stats = FollowStats()

    @property
    def r(self) -> redis.Redis:
        if self._r is None:
            self._r = redis.Redis.from_url(self.redis_url)
        return self._r

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = self.settings.open()
        return self._store

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.redis_url:
            state["_r"] = None
        if isinstance(self.settings, StoreSettings):
            state["_store"] = None
        return state

    def complete(self) -> bool:
        """True when every planned batch is recorded done and the producer has nothing left to plan."""
        keys = RunKeys(self.run)
        total, planning = self.r.hmget(keys.totals, "batches", "planning")
        return not (planning and int(planning)) and total is not None and self.r.scard(keys.done) == int(total)

    def generation(self) -> str:
        """The id of the ledger's done sequence now; refuses (ReaderError) when ``self.cursor`` was counted in
        another one."""
        generation = ledger.sequence_generation(self.r, self.run)
        if self.cursor.generation and self.cursor.generation != generation:
            raise ReaderError(f"run {self.run!r}: cursor {self.cursor} was counted in done sequence "
                              f"{self.cursor.generation}, but the ledger's is now {generation} (rebuilt after a "
                              "Redis loss?): its position names other batches; start again from 0:0")
        return generation

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ReaderError("RunFollower reads the ledger's order: use one DataLoader worker per rank (num_workers 0 or 1)")
        rank, world_size = _rank_world(self.rank, self.world_size)
        position, row = self.cursor.position, self.cursor.row
        generation = self.generation()
        ledger.sequence_done(self.r, self.run)
        while True:
            bid = self.next_batch_id(position)
            if bid is None:
                return
            if position % world_size == rank:
                yield from self._samples(position, bid, row, generation)
            position, row = position + 1, 0

    def next_batch_id(self, position: int) -> str | None:
        """The batch at ``position`` of the ledger's sequence, waiting for it; None once the run is complete
        and the sequence has no such position."""
        keys, waited = RunKeys(self.run), 0.0
        while True:
            ids = self.r.lrange(keys.done_seq, position, position)
            if ids:
                return text(ids[0])
            if self.complete():
                ledger.sequence_done(self.r, self.run)   # batches recorded by an hsx without done_seq
                if self.r.llen(keys.done_seq) <= position:
                    return None
                continue
            if self.timeout_seconds is not None and waited >= self.timeout_seconds:
                raise ReaderError(f"run {self.run!r}: no batch recorded done for {waited:.0f} s "
                                  f"(at position {position}); is the pipeline running? (`hsx status --run {self.run}`)")
            time.sleep(self.poll_seconds)
            waited += self.poll_seconds
            self.stats.waited_seconds += self.poll_seconds

    def _done_info(self, bid: str) -> dict:
        """The ledger's record of ``bid`` ({key, size, sha256}), waiting while a repair has taken it out."""
        waited = 0.0
        while True:
            raw = self.r.hget(RunKeys(self.run).done_info, bid)
            if raw:
                return json.loads(raw)
            if self.timeout_seconds is not None and waited >= self.timeout_seconds:
                raise ReaderError(f"run {self.run!r}: batch {bid} left the ledger (repair?) and was not recorded "
                                  f"done again within {waited:.0f} s")
            time.sleep(self.poll_seconds)
            waited += self.poll_seconds

    def spec(self, bid: str) -> ledger.BatchSpec:
        spec = ledger.get_spec(self.r, self.run, layout.segment(bid, "batch id"))
        if spec is None:
            raise ReaderError(f"run {self.run!r}: batch {bid} is in the ledger but not in the plan")
        return spec

    def read_batch(self, bid: str) -> tuple[ledger.BatchSpec, str, BatchContents]:
        """(spec, store URL, decoded contents) of done batch ``bid``: its object fetched whole and checked
        against the size and SHA-256 the ledger recorded (waiting while a repair has taken it out)."""
        spec = self.spec(bid)
        info = self._done_info(bid)
        key = layout.batch_key(self.run, spec.shard, bid)   # derived, not taken from Redis
        where = self.store.url(key)
        buf = fetch_object(self.store, key)
        if self.verify:
            check_digest(buf, where, int(info["size"]), str(info["sha256"]))
        contents = decode(buf, where, self.manifest)
        self.stats.batches += 1
        self.stats.bytes_read += buf.numel()
        self.stats.seen_at[bid] = time.time()
        return spec, where, contents

    def sample(self, spec: ledger.BatchSpec, where: str, contents: BatchContents, row: int) -> dict:
        """Row ``row`` of a batch read by ``read_batch``: hsx_reader's sample dict plus ``batch_id``."""
        key = layout.batch_key(self.run, spec.shard, spec.batch_id)
        sample = sample_of(contents, SampleRef(-1, spec.sample_ids[row], key, spec.batch_id, row), where)
        sample["batch_id"] = spec.batch_id
        return sample

    def _samples(self, position: int, bid: str, first_row: int, generation: str):
        spec, where, contents = self.read_batch(bid)
        n = len(spec.sample_ids)
        for row in range(first_row, n):
            sample = self.sample(spec, where, contents, row)
            after = Cursor(position + 1, 0, generation) if row + 1 == n else Cursor(position, row + 1, generation)
            sample["cursor"] = str(after)
            self.stats.samples += 1
            yield sample
