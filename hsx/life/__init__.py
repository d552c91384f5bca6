"""A batch's and a run's life in Redis: the face of the wing.

The run's keys (``RunKeys``), its ledger (plan, manifest, done, failures, the done sequence), a batch's
transitions (``batchlife``: one function per change of state), leases, rq queues and jobs, heartbeats, the
reconciler, the ledger rebuilt from the store, a batch object checked against the plan, a batch file's
provenance, reset, and sealing a run (its index and error records). ``records`` is a namespace: the shapes of
hsx's Redis records, read without trusting them. Everything not named in ``__all__`` is private to the wing.
"""

from __future__ import annotations

from hsx.life import records
from hsx.life.batchlife import (
    UPLOAD_FAILURES,
    IllegalTransition,
    State,
    UploadFailure,
    enqueue,
    fail,
    finish,
    hand_back,
    lease,
    reap,
    release,
    release_if_done,
    requeue_upload,
    retry,
    spool,
    upload_failed,
    uploading,
    withdraw,
)
from hsx.life.computeerror import (
    BF16_REFERENCE,
    DEQUANTISED_REFERENCE,
)
from hsx.life.computeerror import (
    claim as claim_compute_error,
)
from hsx.life.computeerror import (
    read as compute_error,
)
from hsx.life.computeerror import (
    record as record_compute_error,
)
from hsx.life.computeerror import (
    recorded as compute_error_recorded,
)
from hsx.life.errorlog import read as recent_failures
from hsx.life.fp8error import ERROR_SAMPLE_EVERY, record_store_error
from hsx.life.fp8error import summary as store_error_summary
from hsx.life.heartbeat import (
    publish_current,
    publish_heartbeat,
    publish_host,
    read_hosts,
    read_workers,
    ttl_seconds,
)
from hsx.life.heartbeat import (
    sweep as sweep_heartbeats,
)
from hsx.life.idle import run_complete
from hsx.life.index import write_index_if_complete
from hsx.life.integrity import check_batch, repair_batches, requeue_orphans, unmark_missing_done
from hsx.life.keys import RunKeys
from hsx.life.leases import redis_now
from hsx.life.leases import refresh as refresh_leases
from hsx.life.ledger import (
    WRITTEN_BYTES,
    BatchSpec,
    RunVanished,
    SequenceWindow,
    all_specs,
    dead_letters,
    done_ids,
    done_info,
    drop_failures_of_done,
    failures,
    get_manifest,
    get_spec,
    is_done,
    list_runs,
    require_manifest,
    save_plan,
    sequence_done,
    sequence_generation,
    sequence_window,
)
from hsx.life.provenance import INCARNATION, file_mismatch
from hsx.life.queues import (
    EXTRACT_FUNC,
    RESULT_TTL,
    UPLOAD_FUNC,
    UploadJob,
    batch_of_job,
    extract_queue_name,
    job_class,
    pending_extract,
    pending_upload,
    queue,
    rq_without_pickle,
    upload_queue_name,
)
from hsx.life.rebuild import Rebuild, rebuild_done
from hsx.life.reconcile import maybe_reconcile, orphans
from hsx.life.reset import apply_reset, plan_reset

__all__ = [
    "RunKeys",
    "BatchSpec",
    "RunVanished",
    "SequenceWindow",
    "WRITTEN_BYTES",
    "all_specs",
    "dead_letters",
    "done_ids",
    "done_info",
    "drop_failures_of_done",
    "failures",
    "get_manifest",
    "get_spec",
    "is_done",
    "list_runs",
    "require_manifest",
    "save_plan",
    "sequence_done",
    "sequence_generation",
    "sequence_window",
    "IllegalTransition",
    "State",
    "enqueue",
    "fail",
    "finish",
    "hand_back",
    "lease",
    "reap",
    "release",
    "release_if_done",
    "requeue_upload",
    "retry",
    "spool",
    "upload_failed",
    "UploadFailure",
    "UPLOAD_FAILURES",
    "UploadJob",
    "uploading",
    "withdraw",
    "redis_now",
    "refresh_leases",
    "EXTRACT_FUNC",
    "RESULT_TTL",
    "UPLOAD_FUNC",
    "batch_of_job",
    "extract_queue_name",
    "job_class",
    "pending_extract",
    "pending_upload",
    "queue",
    "rq_without_pickle",
    "upload_queue_name",
    "publish_current",
    "publish_heartbeat",
    "publish_host",
    "read_hosts",
    "read_workers",
    "sweep_heartbeats",
    "ttl_seconds",
    "maybe_reconcile",
    "orphans",
    "Rebuild",
    "rebuild_done",
    "check_batch",
    "repair_batches",
    "requeue_orphans",
    "unmark_missing_done",
    "INCARNATION",
    "file_mismatch",
    "apply_reset",
    "plan_reset",
    "write_index_if_complete",
    "run_complete",
    "recent_failures",
    "BF16_REFERENCE",
    "DEQUANTISED_REFERENCE",
    "claim_compute_error",
    "compute_error",
    "compute_error_recorded",
    "record_compute_error",
    "ERROR_SAMPLE_EVERY",
    "record_store_error",
    "store_error_summary",
    "records",
]
