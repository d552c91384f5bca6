"""A batch's and a run's life in Redis: the face of the wing.

The run's keys (``RunKeys``), its ledger (plan, manifest, done, failures, the done sequence), a batch's
transitions (``batchlife``: one function per change of state), leases, rq queues and jobs, heartbeats, the
reconciler, the ledger rebuilt from the store, a batch object checked against the plan, a batch file's
provenance, reset, sealing a run (its index and error records), the run as a whole (here? planned only? still
planning? what is left?) and the producer's window records. ``records`` is a namespace: the shapes of
hsx's Redis records, read without trusting them. Everything not named in ``__all__`` is private to the wing.
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "records": {"records": None},  # a namespace
    "batchlife": [
        "IllegalTransition",
        "State",
        "enqueue",
        "fail",
        "feed",
        "fed_count",
        "finish",
        "hand_back",
        "lease",
        "reap",
        "release",
        "release_if_done",
        "requeue_upload",
        "retry",
        "spool",
        "start_feeding",
        "upload_failed",
        "uploading",
        "withdraw",
    ],
    "computeerror": {
        "BF16_REFERENCE": None,
        "DEQUANTISED_REFERENCE": None,
        "claim": "claim_compute_error",
        "read": "compute_error",
        "record": "record_compute_error",
        "recorded": "compute_error_recorded",
    },
    "donesequence": ["SequenceWindow", "sequence_done", "sequence_generation", "sequence_length", "sequence_window"],
    "errorlog": {"read": "recent_failures"},
    "fp8error": {"ERROR_SAMPLE_EVERY": None, "record_store_error": None, "summary": "store_error_summary"},
    "heartbeat": {
        "publish_current": None,
        "publish_heartbeat": None,
        "publish_host": None,
        "publish_stopped": None,
        "read_hosts": None,
        "read_workers": None,
        "ttl_seconds": None,
        "worker_alive": None,
        "sweep": "sweep_heartbeats",
    },
    "idle": ["run_complete"],
    "index": ["write_index_if_complete"],
    "integrity": ["check_batch", "repair_batches", "requeue_orphans", "unmark_missing_done"],
    "keys": ["RunKeys"],
    "leases": {"redis_now": None, "refresh_extract": "refresh_extract_leases",
               "refresh_upload": "refresh_upload_leases"},
    "ledger": [
        "WRITTEN_BYTES",
        "BatchSpec",
        "RunVanished",
        "all_specs",
        "dead_letters",
        "done_among",
        "done_ids",
        "done_info",
        "done_record",
        "drop_failures_of_done",
        "failures",
        "get_manifest",
        "get_spec",
        "get_specs",
        "is_done",
        "list_runs",
        "require_manifest",
        "save_plan",
        "uploaded_since",
    ],
    "prefixerror": {"WARN_REL_L2": "PREFIX_WARN_REL_L2", "line": "prefix_error_line", "read": "prefix_error",
                    "record": "record_prefix_error", "recorded": "prefix_error_recorded"},
    "planids": ["PlanIdsError", "plan_ids", "read_window_ids", "with_ids", "write_window_ids"],
    "provenance": ["INCARNATION", "file_mismatch"],
    "queues": [
        "EXTRACT_FUNC",
        "RESULT_TTL",
        "UPLOAD_FUNC",
        "UploadJob",
        "batch_of_job",
        "extract_queue_name",
        "job_class",
        "pending_extract",
        "pending_upload",
        "queue",
        "rq_without_pickle",
        "upload_queue_name",
    ],
    "rebuild": ["Rebuild", "rebuild_done"],
    "reconcile": ["maybe_reconcile", "orphans"],
    "reset": ["apply_reset", "plan_reset"],
    "runstate": ["Outstanding", "mark_planned_only", "outstanding", "planning_in_progress", "run_exists",
                 "unmark_planned_only"],
    "uploadpolicy": ["UPLOAD_FAILURES", "UploadFailure"],
    "weightsrecord": {"WeightsRecordError": None, "read": "recorded_weights", "record": "record_weights"},
    "windowrecords": ["forget_windows_from", "save_window", "window_records"],
})
