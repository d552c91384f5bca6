"""Every Redis key hsx writes, in one place.

Each template names what it holds, its Redis type and its lifetime. Keys of a
run live under ``hsx:<run>:``. Nothing here talks to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNS = "hsx:runs"  # SET of run names, no TTL
LOG_SECONDS = 3600  # how long done_log and spooled_log keep a batch (s): the stall check, the last activity...
LOG_KEEP = 256  # ...and how many batches at most (the rates and the chart read rate_minutes: O(minutes), not batches)
UPLOADED_SECONDS = 3600  # how long a host's ``uploaded`` ZSET remembers a batch (s): longer than any rate window


@dataclass(frozen=True)
class RunKeys:
    run: str

    def _k(self, suffix: str) -> str:
        return f"hsx:{self.run}:{suffix}"

    @property
    def manifest(self) -> str:  # STRING, JSON manifest; no TTL
        return self._k("manifest")

    @property
    def plan(self) -> str:  # HASH batch_id -> JSON batch spec; no TTL
        return self._k("plan")

    @property
    def totals(self) -> str:  # HASH planned totals (batches, samples, tokens, ...); no TTL
        return self._k("totals")

    @property
    def done_prefix(self) -> str:  # prefix of the done ledger's chunks (hsx/life/doneledger.py)
        return self._k("done:")

    def done_chunk(self, chunk: str) -> str:  # HASH (listpack, <= 100 fields) last 2 chars of a batch id -> done
        # record: raw SHA-256 + size in decimal, or "" (done once, taken out again); the ledger; no TTL
        return self.done_prefix + chunk

    @property
    def done_chunks(self) -> str:  # SET of the chunk names done_chunk keys were written for; no TTL
        return self._k("done_chunks")

    # The ledger of an older hsx (read only by hsx/life/oldledger.py, which converts it):
    @property
    def done(self) -> str:  # SET of batch ids verified in the store; no TTL
        return self._k("done")

    @property
    def done_info(self) -> str:  # HASH batch_id -> JSON {size, sha256} (an older hsx's: + key, by, ts); no TTL
        return self._k("done_info")

    @property
    def done_seq_pos(self) -> str:  # HASH batch_id -> its 0-based position in done_seq; no TTL
        return self._k("done_seq_pos")

    @property
    def counters(self) -> str:  # HASH done counters (batches, samples, tokens, bytes); no TTL
        return self._k("counters")

    @property
    def shard_done(self) -> str:  # HASH shard -> batches done; no TTL
        return self._k("shard_done")

    @property
    def done_seq(self) -> str:  # LIST of batch ids in the order first recorded done (what a follower reads); a
        # batch taken out of the ledger and done again keeps its first place (its emptied done record says so); no TTL
        return self._k("done_seq")

    @property
    def done_seq_generation(self) -> str:  # STRING: random id of this done_seq (gone with it after a Redis loss); no TTL
        return self._k("done_seq_generation")

    @property
    def done_log(self) -> str:  # ZSET batch_id scored by unix time it was recorded done, the last LOG_SECONDS (trimmed
        # on each write; an older hsx's run: every batch); no TTL
        return self._k("done_log")

    @property
    def rate_minutes(self) -> str:  # HASH "<spooled|done>:<unix minute>:<b|s|t>" -> batches, samples, tokens first
        # spooled / recorded done in that minute: the rates read in O(minutes), not O(batches in the window); and
        # "<spooled|done>:first" (unix s of the run's first), "spooled:count" (batches first spooled); no TTL
        return self._k("rate_minutes")

    @property
    def spooled_log(self) -> str:  # ZSET batch_id scored by unix time it reached a spool, the last LOG_SECONDS
        # (trimmed on each write; an older hsx's run: every batch); no TTL
        return self._k("spooled_log")

    @property
    def failures(self) -> str:  # HASH batch_id -> JSON {attempts, last_error, ts}; no TTL
        return self._k("failures")

    @property
    def dead(self) -> str:  # HASH batch_id -> JSON {attempts, last_error, ts}: dead letters; no TTL
        return self._k("dead")

    @property
    def workers(self) -> str:  # ZSET worker_name scored by last heartbeat unix time; no TTL
        return self._k("workers")

    def heartbeat(self, worker_name: str) -> str:  # STRING JSON stats; TTL heartbeat_ttl
        return self._k(f"hb:{worker_name}")

    @property
    def worker_last(self) -> str:  # HASH worker_name -> JSON of its last heartbeat; no TTL, swept with `workers`
        return self._k("worker_last")

    @property
    def worker_batch(self) -> str:  # HASH worker_name -> batch id it leased last; no TTL, swept with `workers`
        return self._k("worker_batch")

    @property
    def error_log(self) -> str:  # LIST JSON {batch, error, attempts, ts}, newest first, ERROR_LOG_LENGTH long; no TTL
        return self._k("error_log")

    @property
    def extract_leases(self) -> str:  # ZSET batch_id scored by lease expiry (s, Redis TIME): extracting, not yet spooled
        return self._k("extract_leases")

    @property
    def upload_leases(self) -> str:  # ZSET batch_id scored by lease expiry (s, Redis TIME): being uploaded
        return self._k("upload_leases")

    @property
    def upload_jobs(self) -> str:  # HASH batch_id -> JSON upload job kwargs + host, while leased; no TTL
        return self._k("upload_jobs")

    @property
    def kept_uploads(self) -> str:  # HASH batch_id -> JSON upload job kwargs + host: a dead letter whose spool file
        return self._k("kept_uploads")  # was kept (the store refused it); retry uploads it again; no TTL

    @property
    def windows(self) -> str:  # HASH window number -> JSON record of a planned + enqueued window (producer resume); no TTL
        return self._k("windows")

    @property
    def producer_lock(self) -> str:  # STRING owner token of the one producer of the run; PX TTL, refreshed while it runs
        return self._k("producer_lock")

    @property
    def planned_only(self) -> str:  # STRING "1": planned by `hsx produce --no-enqueue`, not started; no TTL
        # (the `hsx produce` that enqueues removes it). No reconciler enqueues such a run.
        return self._k("planned_only")

    @property
    def resetting(self) -> str:  # STRING "1": `hsx reset` is removing the run; no TTL (removed with the run)
        return self._k("resetting")

    @property
    def fed(self) -> str:  # STRING int: batches 0 .. fed-1 were given their first extract job (the queue is fed
        # QUEUE_AHEAD jobs ahead, never the whole plan: hsx.life.batchlife.feed); absent: every planned batch was
        # (a run planned by an older hsx); no TTL
        return self._k("fed")

    @property
    def job_seq(self) -> str:  # STRING counter: unique suffix of re-enqueued job ids; no TTL
        return self._k("job_seq")

    @property
    def hosts(self) -> str:  # HASH host -> JSON spool stats {bytes, files, budget, ts}; no TTL
        return self._k("hosts")

    def uploaded(self, host: str) -> str:  # ZSET batch_id scored by unix time ``host``'s uploaders recorded it done;
        # trimmed to the last UPLOADED_SECONDS and LOG_KEEP batches on each write (the host's upload rate is read
        # from rate_minutes' ``up:<host>:...`` counts; an older hsx's run: from here); no TTL
        return self._k(f"uploaded:{host}")

    @property
    def upload_refused(self) -> str:  # HASH host -> JSON {cause, message, jobs, ts}: uploads a host refuses; no TTL
        return self._k("upload_refused")

    @property
    def store_error(self) -> str:  # HASH batch_id -> JSON {rel_l2, cosine, tokens} per layer, FP8 vs bf16; no TTL
        return self._k("store_error")

    @property
    def compute_error(self) -> str:  # STRING JSON {rel_l2, cosine, ...} per stored layer, FP8 vs bf16 compute; SET NX; no TTL
        return self._k("compute_error")

    @property
    def model_weights(self) -> str:  # STRING JSON {fingerprint, model, worker, host, ts}: the weights fingerprint the
        # first worker to load the model recorded, where the manifest holds none in this hsx's scheme; SET NX; no TTL
        return self._k("model_weights")

    @property
    def evaluation(self) -> str:  # STRING JSON: the last `hsx evaluate` of a drafter trained on the run (tau, ...); no TTL
        return self._k("evaluation")

    @property
    def prefix_error(self) -> str:  # STRING JSON {rel_l2, cosine, ...} per stored layer, shared-prefix samples vs the
        return self._k("prefix_error")  # same samples alone (hsx/life/prefixerror.py); SET NX; no TTL

    @property
    def compute_error_claim(self) -> str:  # STRING worker measuring the compute error; TTL the run's lease (EX)
        return self._k("compute_error_claim")

    @property
    def store_refusal(self) -> str:  # STRING JSON {error, batch, ts, by}: last permanent store error; cleared on upload; no TTL
        return self._k("store_refusal")

    @property
    def orphans(self) -> str:  # HASH batch_id -> Redis TIME it was first seen in no queue/lease/ledger/dead; no TTL
        return self._k("orphans")

    @property
    def reconcile_cursor(self) -> str:  # STRING int: the next batch index a reconciler pass checks of a run fed in
        # steps (it goes round [0, fed), RECONCILE_CHUNK a pass); no TTL
        return self._k("reconcile_cursor")

    @property
    def reconcile_lock(self) -> str:  # STRING "1": a reconciler pass was made; TTL the reconcile interval (PX)
        return self._k("reconcile_lock")

    @property
    def index_written(self) -> str:  # STRING the index's store key, set once the index is written; no TTL
        return self._k("index")
