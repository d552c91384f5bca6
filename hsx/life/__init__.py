"""A batch's and a run's life in Redis: the face of the wing.

The run's keys (``RunKeys``), its ledger (plan, manifest, done, failures, the done sequence), a batch's
transitions (``batchlife``: one function per change of state), leases, rq queues and jobs, heartbeats, the
reconciler, the ledger rebuilt from the store, a batch object checked against the plan, a batch file's
provenance, reset, sealing a run (its index and error records), the run as a whole (here? planned only? still
planning? what is left?) and the producer's window records. ``records`` is a namespace: the shapes of
hsx's Redis records, read without trusting them. Everything not named in ``__all__`` is private to the wing.
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.face import face
from hsx.life import records
from hsx.life.computeerror import (
    BF16_REFERENCE,
    DEQUANTISED_REFERENCE,
    claim_compute_error,
    compute_error,
    compute_error_recorded,
    record_compute_error,
)
from hsx.life.donesequence import SequenceWindow, sequence_done, sequence_generation, sequence_length, sequence_window
from hsx.life.errorlog import recent_failures
from hsx.life.heartbeat import (
    publish_current,
    publish_heartbeat,
    publish_host,
    publish_stopped,
    read_hosts,
    read_workers,
    sweep_heartbeats,
    ttl_seconds,
    worker_alive,
)
from hsx.life.idle import run_complete
from hsx.life.keys import RunKeys
from hsx.life.leases import redis_now, refresh_extract_leases, refresh_upload_leases
from hsx.life.ledger import (
    WRITTEN_BYTES,
    BatchSpec,
    RunVanished,
    all_specs,
    dead_letters,
    done_among,
    done_count,
    done_counters,
    done_ids,
    done_info,
    done_record,
    done_records,
    drop_failures_of_done,
    failures,
    get_manifest,
    get_spec,
    get_specs,
    is_done,
    list_runs,
    require_manifest,
    save_plan,
    uploaded_since,
)
from hsx.life.oldledger import OldLedger, convert_old_ledger, old_ledger
from hsx.life.prefixerror import (
    PREFIX_WARN_REL_L2,
    prefix_error,
    prefix_error_line,
    prefix_error_recorded,
    record_prefix_error,
)
from hsx.life.runstate import (
    Outstanding,
    mark_planned_only,
    outstanding,
    planning_in_progress,
    run_exists,
    unmark_planned_only,
)
from hsx.life.storeerror import ERROR_SAMPLE_EVERY, record_store_error, store_error_summary
from hsx.life.uploadpolicy import UPLOAD_FAILURES, UploadFailure
from hsx.life.weightsrecord import WeightsRecordError, record_weights, recorded_weights
from hsx.life.windowrecords import forget_windows_from, save_window, window_records

if TYPE_CHECKING:  # these modules import rq or torch: loaded on first use (hsx/face.py)
    from hsx.life.batchlife import (
        IllegalTransition,
        State,
        enqueue,
        fail,
        fed_count,
        feed,
        finish,
        hand_back,
        lease,
        reap,
        release,
        release_if_done,
        requeue_upload,
        retry,
        spool,
        start_feeding,
        upload_failed,
        uploading,
        withdraw,
    )
    from hsx.life.index import write_index_if_complete
    from hsx.life.integrity import check_batch, repair_batches, requeue_orphans, unmark_missing_done
    from hsx.life.planids import PlanIdsError, plan_ids, read_window_ids, with_ids, write_window_ids
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

__getattr__, __dir__, __all__ = face(__name__, __file__)
