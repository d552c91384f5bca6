"""The processes that serve runs: the face of the wing.

The skeleton every long-running role shares (``Role``: runtime slot, heartbeat, progress log, rq worker, name
claim, stop; ``RqWorker``: rq's worker with a role's hooks, the one door to rq's internals), the housekeeping its
heartbeat makes for each run the role keeps (``Chores``: reap, reconcile, rq's registry kept in step with hsx's
heartbeats), Redis' eviction policy and multipart uploads left by dead uploaders. (The refusals a role records,
uploads a host refuses and a store that refuses for good, are the run's records: ``hsx.life.Run``.)
Everything not named in ``__all__`` is private to the wing.
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.face import face
from hsx.fleet.evictionpolicy import check_eviction_policy
from hsx.fleet.housekeeping import AFTER_RECONCILE, BEFORE_RECONCILE, Chores
from hsx.fleet.multipart import abort_stale_uploads, incomplete_uploads

if TYPE_CHECKING:  # these modules import rq: loaded on first use (hsx/face.py)
    from hsx.fleet.role import Role
    from hsx.fleet.rqworker import RqWorker

__getattr__, __dir__, __all__ = face(__name__, __file__)
