"""Follow a run while it is extracted: samples of each batch as the ledger records it done, until COMPLETE.

The ledger, not the store listing, says which batches exist: the follower
reads the run's ``done_seq`` (a Redis LIST the uploader appends a batch id to
when it first records the batch done, see ``hsx.life.ledger.mark_done``), fetches
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
rebuilt from the store after a Redis loss (or a run reset and produced again)
records its batches again in another order, under a new ``done_seq_generation``
(``hsx.life.Run.sequence_generation``); a Redis rolled back a few seconds (an AOF
``everysec`` power loss, an async replica promoted, a restore) keeps the
generation but loses the tail of the sequence, which is then recorded again in
another order. So a cursor names the generation it was counted in and the batch
its last sample came from (``POSITION:ROW@GENERATION/BATCH``), and the follower
checks both: on resume, and, as it goes, every time it looks at the ledger (the
generation, and that the batch it read last is still at its place). A change
is refused (ReaderError, one line) instead of going on at a place that names
other batches. A cursor without them (``POSITION:ROW``, written before) is
taken as it is.

Waiting: while the run is not complete and no next batch is recorded, the
follower says every ``notice_seconds`` what it waits for (log line: batches
not done, dead letters among them). When only dead letters are left (every
other planned batch done, planning over), ``on_dead_letter`` decides: ``wait``
(default: until ``hsx retry-failed`` brings them back), ``skip`` (end the
iteration without them, saying which), or ``stop`` (ReaderError naming them).

A follower given a Redis URL connects the way hsx's roles do
(``hsx.redisconn.connect(..., ride_out=True)``): a Redis restart is waited out.

The iteration ends when the run is COMPLETE (every planned batch done, the
producer done planning) and every done batch was read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis
from torch.utils.data import IterableDataset, get_worker_info

from hsx import life
from hsx.redisconn import connect
from hsx.store import Store, StoreSettings, layout
from hsx_reader.cursor import Cursor
from hsx_reader.objects import BatchContents, check_digest, decode, fetch_object
from hsx_reader.run import Expectations, ReaderError, SampleRef
from hsx_reader.source import sample_of
from hsx_reader.stream import _rank_world

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2      # how often the ledger is asked for new batches when none is waiting
NOTICE_SECONDS = 60.0   # how often a waiting follower says what it waits for (log line)
ON_DEAD_LETTER = ("wait", "skip", "stop")   # what a follower does when only dead letters are left


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
                 rank: int | None = None, world_size: int | None = None, on_dead_letter: str = "wait",
                 notice_seconds: float = NOTICE_SECONDS):
        """``redis_client``: a client or URL of the Redis holding the run's ledger (a URL is connected to as the
        roles connect: Redis restarts are waited out). ``store``: defaults to the one the run's manifest
        recorded. ``timeout_seconds``: raise ReaderError if no batch is recorded done for that long (None: wait
        as long as the run is not complete). ``on_dead_letter``: wait, skip or stop when only dead letters are
        left (module docstring); ``notice_seconds``: how often a waiting follower logs what it waits for."""
        if on_dead_letter not in ON_DEAD_LETTER:
            raise ReaderError(f"on_dead_letter {on_dead_letter!r}: expected one of {', '.join(ON_DEAD_LETTER)}")
        self.redis_url = redis_client if isinstance(redis_client, str) else None
        self._r = connect(redis_client, ride_out=True) if isinstance(redis_client, str) else redis_client
        self.run = layout.check_run_name(run)
        self._ledger: life.Run | None = None
        self.manifest = self.ledger.require_manifest()
        (expect or Expectations()).check(self.manifest, run)
        if store is None:
            store = self.manifest.store
        self.settings = StoreSettings(url=store) if isinstance(store, str) else store
        self._store = store if isinstance(store, Store) else None
        self.cursor = Cursor.parse(cursor)
        if self.cursor.generation or self.cursor.last:
            self.check_cursor()   # a cursor of a lost or rolled-back ledger is refused here, not at the first batch
        self.poll_seconds, self.timeout_seconds, self.verify = poll_seconds, timeout_seconds, verify
        self.on_dead_letter, self.notice_seconds = on_dead_letter, notice_seconds
        self.rank, self.world_size = rank, world_size
        self.stats = FollowStats()

    @property
    def r(self) -> redis.Redis:
        if self._r is None:   # unpickled in a DataLoader worker: no wait for Redis here, outages ridden out
            self._r = connect(self.redis_url, ride_out=True, wait_seconds=0)
        return self._r

    @property
    def ledger(self) -> life.Run:
        """The run's handle on ``self.r`` (made again after unpickling, on that process's connection)."""
        if self._ledger is None:
            self._ledger = life.Run(self.r, self.run)
        return self._ledger

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = self.settings.open()
        return self._store

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_ledger"] = None
        if self.redis_url:
            state["_r"] = None
        if isinstance(self.settings, StoreSettings):
            state["_store"] = None
        return state

    def pending(self) -> life.Outstanding:
        """What a waiting follower waits for: planned batches, done batches and dead letters not done, now."""
        return self.ledger.outstanding()

    def complete(self) -> bool:
        """True when every planned batch is recorded done and the producer has nothing left to plan."""
        return self.pending().complete

    def generation(self) -> str:
        """The id of the ledger's done sequence now; refuses (ReaderError) when ``self.cursor`` was counted in
        another one."""
        generation = self.ledger.sequence_generation()
        if self.cursor.generation and self.cursor.generation != generation:
            raise ReaderError(f"run {self.run!r}: cursor {self.cursor} was counted in done sequence "
                              f"{self.cursor.generation}, but the ledger's is now {generation} (rebuilt after a "
                              "Redis loss, or the run reset?): its position names other batches; start again from 0:0")
        return generation

    def check_cursor(self) -> str:
        """``generation()``, and the batch the cursor names must still be at its place (else Redis lost writes)."""
        generation = self.generation()
        if self.cursor.last:
            window = self.ledger.sequence_window(self.cursor.anchor + 1)
            self._check_window(window, self.cursor.anchor + 1, generation, self.cursor.last, what=f"cursor {self.cursor}")
        return generation

    def _check_window(self, window: life.SequenceWindow, position: int, generation: str, previous: str,
                      what: str = "this follower") -> None:
        """Refuse a done sequence that changed under the follower: another generation (rebuilt or reset), or
        ``previous`` (the batch read at ``position - 1``) no longer there (rolled back)."""
        if generation and window.generation != generation:
            raise ReaderError(f"run {self.run!r}: the ledger's done sequence changed under {what} at position "
                              f"{position} (generation {generation} -> {window.generation}: rebuilt after a Redis "
                              "loss, or the run reset): its positions now name other batches; start again from 0:0")
        if previous and window.before != previous:
            now = f"holds {window.before}" if window.before else f"has only {window.length} entries"
            raise ReaderError(f"run {self.run!r}: position {position - 1} of the done sequence held batch {previous} "
                              f"when {what} read it, and now {now}: Redis lost its latest writes (rolled back: an AOF "
                              "everysec power loss, an async replica promoted, a restore), so the positions from "
                              "there on name other batches (samples would be skipped and repeated); start again "
                              "from 0:0")

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ReaderError("RunFollower reads the ledger's order: use one DataLoader worker per rank (num_workers 0 or 1)")
        rank, world_size = _rank_world(self.rank, self.world_size)
        position, row = self.cursor.position, self.cursor.row
        generation = self.check_cursor()
        previous = self.cursor.last if row == 0 else ""   # the batch at position - 1, when known
        self.ledger.sequence_done()
        while True:
            bid = self.next_batch_id(position, generation, previous)
            if bid is None:
                return
            if position % world_size == rank:
                yield from self._samples(position, bid, row, generation)
            previous = bid
            position, row = position + 1, 0

    def next_batch_id(self, position: int, generation: str = "", previous: str = "") -> str | None:
        """The batch at ``position`` of the ledger's sequence, waiting for it; None once the run is complete
        and the sequence has no such position (or only dead letters are left and ``on_dead_letter`` is skip).
        Every look at the ledger checks that its sequence is still ``generation`` and still has ``previous``
        at ``position - 1`` (each: "" = not checked); ReaderError if not."""
        waited, noticed = 0.0, 0.0
        while True:
            window = self.ledger.sequence_window(position)
            self._check_window(window, position, generation, previous)
            if window.at is not None:
                return window.at
            pending = self.pending()
            if pending.complete or (pending.only_dead_left and self.on_dead_letter == "skip"):
                self.ledger.sequence_done()   # batches recorded by an hsx without done_seq
                if self.ledger.sequence_length() <= position:
                    if not pending.complete:
                        log.warning("run %r: ending without %d dead letter(s) (%s), as on_dead_letter='skip' asks; "
                                    "`hsx retry-failed --run %s` re-extracts them", self.run, len(pending.dead),
                                    _some(pending.dead), self.run)
                    return None
                continue
            if pending.only_dead_left and self.on_dead_letter == "stop":
                raise ReaderError(f"run {self.run!r}: only dead letters are left ({len(pending.dead)}: "
                                  f"{_some(pending.dead)}), and on_dead_letter='stop'; `hsx retry-failed --run "
                                  f"{self.run}` re-extracts them, then follow again from the last cursor")
            if self.timeout_seconds is not None and waited >= self.timeout_seconds:
                raise ReaderError(f"run {self.run!r}: no batch recorded done for {waited:.0f} s "
                                  f"(at position {position}); is the pipeline running? (`hsx status --run {self.run}`)")
            if waited - noticed >= self.notice_seconds:
                log.warning(self._waiting_line(position, waited, pending))
                noticed = waited
            time.sleep(self.poll_seconds)
            waited += self.poll_seconds
            self.stats.waited_seconds += self.poll_seconds

    def _waiting_line(self, position: int, waited: float, pending: life.Outstanding) -> str:
        """What a waiting follower waits for, in one line."""
        if pending.batches is None or pending.planning:
            what = "the producer is still planning"
        else:
            what = f"{pending.batches - pending.done} of {pending.batches} planned batches not done yet"
        line = f"run {self.run!r}: waited {waited:.0f} s at position {position} for the next batch: {what}"
        if pending.dead:
            line += (f"; {len(pending.dead)} dead letter(s) ({_some(pending.dead)}) come back only with `hsx "
                     f"retry-failed --run {self.run}`")
            if pending.only_dead_left:
                line += " (nothing else is left: on_dead_letter='skip' ends without them, 'stop' raises)"
        return line

    def _done_info(self, bid: str) -> dict:
        """The ledger's record of ``bid`` ({key, size, sha256}), waiting while a repair has taken it out."""
        waited = 0.0
        while True:
            info = self.ledger.done_record(bid)
            if info is not None:
                return info
            if self.timeout_seconds is not None and waited >= self.timeout_seconds:
                raise ReaderError(f"run {self.run!r}: batch {bid} left the ledger (repair?) and was not recorded "
                                  f"done again within {waited:.0f} s")
            time.sleep(self.poll_seconds)
            waited += self.poll_seconds

    def spec(self, bid: str) -> life.BatchSpec:
        spec = self.ledger.spec(layout.segment(bid, "batch id"))
        if spec is None:
            raise ReaderError(f"run {self.run!r}: batch {bid} is in the ledger but not in the plan")
        return spec

    def spec_with_ids(self, bid: str) -> life.BatchSpec:
        """``spec(bid)`` holding its sample ids: a newer plan keeps them in the store (its inputs object's header,
        one range read)."""
        try:
            return self.ledger.with_ids(self.store, self.spec(bid))
        except life.PlanIdsError as exc:
            raise ReaderError(f"run {self.run!r}: {exc}") from None

    def read_batch(self, bid: str) -> tuple[life.BatchSpec, str, BatchContents]:
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
        if not spec.ids_in_plan:   # a newer plan keeps the ids in the store: the object's, checked
            if not spec.ids_match(contents.sample_ids):
                raise ReaderError(f"{where}: holds other sample ids than the plan of {bid}")
            spec = spec.with_ids(contents.sample_ids)
        self.stats.batches += 1
        self.stats.bytes_read += buf.numel()
        self.stats.seen_at[bid] = time.time()
        return spec, where, contents

    def sample(self, spec: life.BatchSpec, where: str, contents: BatchContents, row: int) -> dict:
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
            after = Cursor(position + 1, 0, generation, bid) if row + 1 == n else Cursor(position, row + 1, generation, bid)
            sample["cursor"] = str(after)
            self.stats.samples += 1
            yield sample


def _some(bids: list[str], shown: int = 5) -> str:
    """Batch ids for a one-line message: the first ``shown``, then how many more."""
    return ", ".join(bids[:shown]) + (f" and {len(bids) - shown} more" if len(bids) > shown else "")
