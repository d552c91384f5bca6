"""What each kind of upload failure does to its batch: the table ``batchlife.upload_failed`` applies.

The uploader says why an upload did not finish (an ``UploadFailure``, from the exception's class); the
row of ``UPLOAD_FAILURES`` for it decides whether the attempt counts, whether the batch is extracted again
or dead-lettered with its spool file kept, and whether the same file is uploaded again after the store
backoff. Data only: nothing here touches Redis.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from hsx.retry import backoff_delay

UPLOAD_RETRY_BASE_SECONDS = 1.0   # backoff between two uploads of one batch while the store is down ...
UPLOAD_RETRY_CAP_SECONDS = 60.0   # ... doubling from 1 s, capped at 60 s


class UploadFailure(str, Enum):
    """Why an upload did not finish, as the uploader tells it; ``UPLOAD_FAILURES`` says what each one does."""

    NOT_HERE = "not here"    # this uploader cannot do it (another --spool-dir, a store it cannot see); no lease taken
    LOST = "lost"            # the spool file is gone, corrupt or not of this plan: the bytes must be computed again
    REFUSED = "refused"      # the store refused for good (access denied, no bucket): no retry helps without a person
    UNPLANNED = "unplanned"  # the batch is not in its run's plan
    TROUBLE = "trouble"      # anything else: a store outage, throttling, a verify mismatch; the file stays


class UploadPolicy(NamedTuple):
    """One row of ``UPLOAD_FAILURES``: what a kind of upload failure does to the batch."""

    counted: bool             # a failed attempt of the batch (``fail``), dead letter at the limit
    dead_at_once: bool        # the limit is 1, not the run's max_attempts
    extract_again: bool       # counted and below the limit: extracted anew (the spool file is of no use)
    keep_file: bool           # a dead letter remembers the spool file: ``retry`` uploads it again
    upload_again: bool        # the same file uploaded again (not if it became a dead letter or was done) ...
    backoff: bool             # ... after the store backoff (the lease held meanwhile), retry count + 1; else at once
    error: str                # the failure record's text before the exception's message


UPLOAD_FAILURES: dict[UploadFailure, UploadPolicy] = {
    UploadFailure.NOT_HERE: UploadPolicy(counted=False, dead_at_once=False, extract_again=False, keep_file=False,
                                         upload_again=True, backoff=False, error=""),
    UploadFailure.LOST: UploadPolicy(counted=True, dead_at_once=False, extract_again=True, keep_file=False,
                                     upload_again=False, backoff=False, error="upload: "),
    UploadFailure.REFUSED: UploadPolicy(counted=True, dead_at_once=False, extract_again=False, keep_file=True,
                                        upload_again=True, backoff=True, error="upload: store refused: "),
    UploadFailure.UNPLANNED: UploadPolicy(counted=True, dead_at_once=True, extract_again=False, keep_file=False,
                                          upload_again=False, backoff=False, error="upload: "),
    UploadFailure.TROUBLE: UploadPolicy(counted=False, dead_at_once=False, extract_again=False, keep_file=False,
                                        upload_again=True, backoff=True, error=""),
}


def upload_backoff(retry: int) -> float:
    """Seconds to wait before the next upload of a batch whose store failed ``retry`` times before."""
    return backoff_delay(retry, UPLOAD_RETRY_BASE_SECONDS, UPLOAD_RETRY_CAP_SECONDS)
