"""The processes that serve runs: the face of the wing.

The skeleton every long-running role shares (``Role``: runtime slot, heartbeat, progress log, rq worker, name
claim, stop), the housekeeping its heartbeat makes for each run the role keeps (``Chores``: reap, reconcile,
rq's registry kept in step with hsx's heartbeats), Redis' eviction policy, multipart uploads left by dead
uploaders and refusals (uploads a host refuses, a store that refuses for good).
Everything not named in ``__all__`` is private to the wing.
"""

from __future__ import annotations

from hsx.fleet.evictionpolicy import check_eviction_policy
from hsx.fleet.housekeeping import AFTER_RECONCILE, BEFORE_RECONCILE, Chores
from hsx.fleet.multipart import abort_stale as abort_stale_uploads
from hsx.fleet.multipart import incomplete_uploads
from hsx.fleet.refused import clear as clear_refused_uploads
from hsx.fleet.refused import read as refused_uploads
from hsx.fleet.refused import record as record_refused_upload
from hsx.fleet.role import Role
from hsx.fleet.storerefusal import clear as clear_store_refusal
from hsx.fleet.storerefusal import read as store_refusal
from hsx.fleet.storerefusal import record as record_store_refusal

__all__ = [
    "Role",
    "Chores",
    "BEFORE_RECONCILE",
    "AFTER_RECONCILE",
    "check_eviction_policy",
    "abort_stale_uploads",
    "incomplete_uploads",
    "clear_refused_uploads",
    "record_refused_upload",
    "refused_uploads",
    "clear_store_refusal",
    "record_store_refusal",
    "store_refusal",
]
