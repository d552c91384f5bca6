"""Whether a batch file belongs to this plan: the proof every batch file carries in its header.

A spool file is named ``<run>/<batch>.safetensors``, so after `hsx reset` and a new `hsx produce` of the same
run name the old incarnation's files look like the new run's (another checkpoint's hidden
states, or other sample sets under the same batch ids, uploaded as this run's batches). A file belongs when its
header names this run, this batch id, exactly the plan's sample ids in order, and the run's incarnation (a random
id in the manifest, minted when the run is first planned and again after a reset: hsx.runspec.manifest.Manifest).
Checked before an upload (uploader), when a worker recovers its spool, and by `hsx verify`.
"""

from __future__ import annotations

from pathlib import Path

from hsx.batch import (
    INCARNATION,  # noqa: F401 (the header key, hsx/batch/meta.py; life's face offers it)
    BatchMeta,
    read_header,
)
from hsx.life.ledger import BatchSpec


def mismatch(metadata: dict | BatchMeta, run: str, spec: BatchSpec, incarnation: str) -> str | None:
    """What in a batch file's header metadata is not of this plan (one line), or None if it belongs."""
    try:
        meta = metadata if isinstance(metadata, BatchMeta) else BatchMeta.from_metadata(metadata)
    except (ValueError, KeyError) as exc:
        return f"its header metadata is malformed ({type(exc).__name__}: {str(exc):.80})"
    if meta.run != run:
        return f"it was written for run {meta.run!r:.80}, not {run!r}"
    if meta.batch_id != spec.batch_id:
        return f"it holds batch {meta.batch_id!r:.40}, not {spec.batch_id}"
    written = meta.incarnation or ""
    if written != incarnation:
        return (f"it was written by incarnation {written or 'none'!s:.40} of run {run}, this run is incarnation "
                f"{incarnation or 'none'} (the run was reset and planned again since)")
    if not spec.ids_match(meta.sample_ids):
        return f"it holds {len(meta.sample_ids)} other sample ids than the plan's {spec.samples} for {spec.batch_id}"
    return None


def file_mismatch(path: Path, run: str, spec: BatchSpec, incarnation: str) -> str | None:
    """``mismatch`` of a local batch file, read from its header; BatchFileError if the header cannot be read."""
    with open(path, "rb") as fh:
        def get_range(start: int, length: int) -> bytes:
            fh.seek(start)
            return fh.read(length)

        header = read_header(get_range, str(path))
    return mismatch(header.meta, run, spec, incarnation)
