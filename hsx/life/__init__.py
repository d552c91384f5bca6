"""A run's life in Redis: the face of the wing, and the Redis data model of hsx.

``Run(r, name)`` is the handle on one run (hsx/life/run.py): the ledger's reads, a batch's changes of state, the
leases, heartbeats and records of its roles, its checks against the store, with the run's limits loaded from its
manifest. Every Redis record of a run is written through it. Beside it, the nouns a caller names: the run's keys
(``RunKeys``), the plan's record (``BatchSpec``), a batch's ``State``, an upload job and why one failed, what is
left of a run (``Outstanding``), a window of the done sequence, a rebuild's result, the errors a caller catches,
``records`` (a namespace: the shapes of hsx's Redis records, read without trusting them), and the rq plumbing a
role's process needs before it has a run (its queues, its job class, JSON instead of pickle). Everything not
named here is private to the wing.
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.face import face
from hsx.life import records
from hsx.life.batchspec import BatchSpec
from hsx.life.donesequence import SequenceWindow
from hsx.life.heartbeat import ttl_seconds
from hsx.life.keys import RunKeys
from hsx.life.leases import redis_now
from hsx.life.ledger import RunVanished
from hsx.life.producerlock import ProducerLock
from hsx.life.run import Run
from hsx.life.runstate import Outstanding
from hsx.life.uploadpolicy import UploadFailure

if TYPE_CHECKING:  # these modules import rq or a store client: loaded on first use (hsx/face.py)
    from hsx.life.batchlife import IllegalTransition, State
    from hsx.life.planids import PlanIdsError
    from hsx.life.queues import (
        EXTRACT_FUNC,
        UPLOAD_FUNC,
        UploadJob,
        batch_of_job,
        job_class,
        queue,
        rq_without_pickle,
        upload_queue_name,
    )
    from hsx.life.rebuild import Rebuild

__getattr__, __dir__, __all__ = face(__name__, __file__)
