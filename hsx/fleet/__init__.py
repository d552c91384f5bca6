"""The processes that serve runs: the face of the wing.

The skeleton every long-running role shares (``Role``: runtime slot, heartbeat, progress log, rq worker, name
claim, stop; ``RqWorker``: rq's worker with a role's hooks, the one door to rq's internals), the housekeeping its
heartbeat makes for each run the role keeps (``Chores``: reap, reconcile, rq's registry kept in step with hsx's
heartbeats), Redis' eviction policy, multipart uploads left by dead uploaders and refusals (uploads a host
refuses, a store that refuses for good).
Everything not named in ``__all__`` is private to the wing.
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "evictionpolicy": ["check_eviction_policy"],
    "housekeeping": ["AFTER_RECONCILE", "BEFORE_RECONCILE", "Chores"],
    "multipart": {"abort_stale": "abort_stale_uploads", "incomplete_uploads": None},
    "refused": {"clear": "clear_refused_uploads", "read": "refused_uploads", "record": "record_refused_upload"},
    "role": ["Role"],
    "rqworker": ["RqWorker"],
    "storerefusal": {"clear": "clear_store_refusal", "read": "store_refusal", "record": "record_store_refusal"},
})
