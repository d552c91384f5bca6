"""Defaults, each with its unit. Every role reads these, never a literal."""

DEFAULT_TOKEN_BUDGET = 32768            # tokens a batch, padded size (rows x longest row)
DEFAULT_MAX_LENGTH = 4096               # tokens a sample
MAX_TOKEN_BUDGET = 2**22                # tokens a batch; beyond this no GPU's memory holds one batch's hidden states
DEFAULT_MAX_BATCH_ROWS = 512            # samples a batch, cap whatever the budget allows
DEFAULT_PAD_MULTIPLE = 8                # tokens: padded row length rounded up to this
DEFAULT_BATCHES_PER_SHARD = 1000        # batches under one <shard>/ folder of the store
DEFAULT_WINDOW_ROWS = 20_000            # dataset rows planned together (sorted + cut) and enqueued as one window
PREFIX_REUSE = ("auto", "off")          # --prefix-reuse: shared prefixes computed once where exact, or never
DEFAULT_PREFIX_MIN_TOKENS = 32          # tokens: rows sharing at least this many leading tokens share one spine
# tokens: the price of one more forward beside its tokens, against what a tree saves. Measured: the 27B hybrid
# in FP8 on an H100 (bench/prefix_reuse.py) computes ~17k tok/s and each extra forward cost ~0.15 s (its
# launches and host work), ~2,500 tokens: the price for a worker that runs tree batches group by group (no
# packed rows). A worker that packs runs them in waves, a spine's forward shared with the batch's other trees,
# and a tree batch storing several budgets fills them: there 512 with 4 stored budgets ran per-turn data 3.24x
# the no-reuse pass, 2560 with 1 budget 1.90x (docs/benchmarks.md, "The defaults, timed"). The default is the
# packing worker's; a group-by-group worker on a plan priced under its own warns at start (docs/data.md)
DEFAULT_PREFIX_FORWARD_TOKENS = 512
# how workers run a tree batch's rows, planned for: packed (one packed row a forward, no padding: a GPU worker with
# fla's varlen kernels, the gpu image's), or padded (each group's rows padded to its longest: workers that cannot
# pack; plan those with GROUPWISE_PREFIX_FORWARD_TOKENS). Runs planned before it was recorded were planned padded
PREFIX_ROWS = ("packed", "padded")
GROUPWISE_PREFIX_FORWARD_TOKENS = 2560
LEGACY_PREFIX_FORWARD_TOKENS = 256      # the price runs planned before it was recorded were planned with
DEFAULT_PREFIX_CACHE_BUDGETS = 2        # token budgets: the most cached spine tokens a batch holds (spine x leaves)
# token budgets a batch of shared-prefix trees may store (its forwards each within one budget): more fills the
# forwards of a tree batch, whose computed tokens are a fraction of its stored ones (docs/data.md). The flag's
# default, AUTO_PREFIX_STORED_BUDGETS, stores up to this many where the pinned host buffers and MAX_TOKEN_BUDGET
# allow (hsx.runspec.identity.fit_stored_budgets)
DEFAULT_PREFIX_STORED_BUDGETS = 4
AUTO_PREFIX_STORED_BUDGETS = 0
MAX_PREFIX_STORED_BUDGETS = 16
DEFAULT_MAX_REJECT_SHARE = 0.01         # share of rows that may be rejected before produce fails
DEFAULT_PRODUCER_LOCK_WAIT = 0.0        # seconds a second producer of a run waits for the first, then refuses
DEFAULT_DTYPE = "bfloat16"              # dtype of the hidden states readers get
STORE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3")  # what batch files may hold (hsx/batch/dtypes.py)
COMPUTE_DTYPES = ("bfloat16", "float8")  # what the target's linear layers compute in (gpu_worker/fp8compute.py)
FP8_ACCUMULATIONS = ("fp32", "fast")     # how FP8 GEMMs accumulate: promoted to fp32, or the tensor cores' fast way
DEFAULT_FP8_ACCUMULATION = "fp32"        # fast: ~3 % faster, ~35 % more error on trained weights (docs/benchmarks.md)
CODECS = ("none", "zstd")               # lossless codecs of the hidden states (hsx/batch/codec.py)
MEMORY_SPOOL_SHM = "/dev/shm"            # the tmpfs holding the memory tier's default folder, hsx-<uid>-<Redis tag>
MEMORY_SPOOL_AUTO_CAP_BYTES = 16 * 2**30  # bytes: the largest memory tier "auto" picks
MEMORY_SPOOL_AUTO_SHARE = 0.5             # share of the tmpfs's free space at start that "auto" takes
MEMORY_SPOOL_AUTO_MIN_BYTES = 1 * 2**30   # bytes: below this "auto" leaves the memory tier off
DEFAULT_DFLASH_LAYERS = 5               # layers the dflash preset picks

DEFAULT_SPOOL_BUDGET_BYTES = 64 * 2**30  # bytes of finished batch files a host may hold
DEFAULT_HEARTBEAT_SECONDS = 5.0          # seconds between worker heartbeats
HEARTBEAT_TTL_BEATS = 6                  # heartbeats a heartbeat key outlives: TTL = interval x this
DEFAULT_HEARTBEAT_TTL_SECONDS = DEFAULT_HEARTBEAT_SECONDS * HEARTBEAT_TTL_BEATS  # seconds, at the default interval
DEFAULT_LEASE_SECONDS = 60               # seconds a batch lease lives without refresh
DEFAULT_GRACE_SECONDS = 120              # seconds a stopping worker may spend writing computed batches
STOP_SECONDS = 10                        # seconds every role takes to exit after SIGTERM, beyond a worker's batch in hand
STOP_DEADLINE_MARGIN_SECONDS = 30        # seconds past its grace a stopping role exits anyway (hsx/fleet/stopping.py)
DEFAULT_MAX_ATTEMPTS = 3                 # attempts a batch gets before the dead-letter record
DEFAULT_EXTRACT_JOB_TIMEOUT = 3600       # seconds rq lets one extract job run
DEFAULT_UPLOAD_JOB_TIMEOUT = 3600        # seconds rq lets one upload job run
DEFAULT_MULTIPART_THRESHOLD = 64 * 2**20  # bytes: objects this large or larger go multipart
DEFAULT_MULTIPART_CHUNK = 64 * 2**20      # bytes a multipart part
DEFAULT_UPLOAD_RETRIES = 8               # attempts of one store call before the job fails
DEFAULT_WRITE_QUEUE = 2                  # computed batches waiting for the spool writer threads
DEFAULT_PINNED_BUFFERS = 3               # pinned host buffers of token_budget x width a GPU worker keeps
MAX_PINNED_BYTES = 64 * 2**30            # bytes: a token budget whose pinned buffers need more is refused by produce
DEFAULT_PREFETCH_BATCHES = 32            # batch inputs a GPU worker fetches ahead (rides out store outages)
DEFAULT_LOG_EVERY_SECONDS = 60.0         # seconds: a long-running role logs a progress line at least this often
DEFAULT_LOG_EVERY_BATCHES = 100          # batches: ... and after every this many batches
DEFAULT_REDIS_CONNECT_SECONDS = 10.0     # seconds a command waits for Redis to answer at start before giving up
DEFAULT_SPOOL_DIR = "/var/spool/hsx"     # local spool directory of a host
DEFAULT_DASHBOARD_HOST = "127.0.0.1"
DEFAULT_DASHBOARD_PORT = 8787

# The worker's forward (gpu_worker/kernels.py): "auto" runs fused kernels (flash-linear-attention's norms, SwiGLU,
# Gated DeltaNet conv and gating) where they are installed and the device is CUDA, and a plain batch's samples as
# one packed row (varlen attention and GDN: no padding computed) where that is exact, else transformers' eager
# forward exactly; "padded" the same fused kernels on right-padded rows; "eager" always transformers' forward.
KERNEL_MODES = ("auto", "padded", "eager")
# A packed row computes no padding but runs other kernels (varlen flash attention, fla's varlen chunks): measured
# on an H100 (docs/benchmarks.md, "Packed rows"), ~2-3 % slower a computed token than the same batch padded
# (27B FP8: 16,384 vs 16,830; 8B FP8: 54,687 vs 55,740). So a batch is packed only where its padding is more
# than this share of its real tokens; a large plan's length-bucketed batches (~0.6 % padding) stay padded.
PACK_MIN_PADDING = 0.03
DEFAULT_KERNELS = "auto"

# Extract jobs a run keeps queued ahead of its workers (jobs): the plan is fed to the queue in steps
# (hsx.life.batchlife.feed), so queued rq job hashes (~1.5 KB each) cost O(workers), not O(run).
QUEUE_AHEAD = 256
