"""One run, read in place for a peer: samples by index position, and the token columns alone.

Position i is line i of the run's index (the numbering ``hsx export`` uses too). Two ways to read a sample:

- ``fetch="object"`` (default): the whole batch object is fetched once, checked against the size and
  SHA-256 the run's index recorded, and kept in a bounded cache (``cache_dir``: on local disk), so every
  later sample of it is read from there. Bytes read from the store over an epoch = the run's size, once.
- ``fetch="range"``: the sample's own rows only (one range request per tensor, plus the object's header
  once): bytes read per sample = that sample's bytes. The object's digest is not checked (it covers the
  whole object); the header and the byte counts are.
"""

from __future__ import annotations

from hsx.store import StoreSettings
from hsx_reader import RunDataset
from hsx_reader.objects import fetch_header, fetch_token_columns

DEFAULT_CACHE_BYTES = 8 * 2**30   # per process; on disk with cache_dir


def open_run(store: str, run: str, fetch: str = "object", cache_dir: str | None = None, endpoint_url: str | None = None,
             cache_bytes: int = DEFAULT_CACHE_BYTES) -> RunDataset:
    return RunDataset(StoreSettings(url=store, endpoint_url=endpoint_url), run, fetch=fetch, cache_dir=cache_dir,
                      cache_bytes=cache_bytes)


def token_columns(ds: RunDataset) -> dict[str, list]:
    """``input_ids``, ``loss_mask`` and ``seq_len`` of every sample in index order, read by range (the hidden
    states are not read), each batch's columns checked against the token digest in its header: what a peer keeps
    in its own small dataset beside the hidden states. An object written before that digest existed is read
    whole and checked against the index's SHA-256 instead."""
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    store, key, rows, tokens = ds.source.store, None, None, None
    for ref in ds.index.samples:
        if key != ref.key:
            key = ref.key
            header = fetch_header(store, ref.key)
            checked = fetch_token_columns(store, header)
            if checked is None:
                whole = ds.source.batch(ref.key)   # object bytes checked against the index's digest
                checked = {"cu_seqlens": whole.cu_seqlens, "input_ids": whole.input_ids, "loss_mask": whole.loss_mask}
            rows, tokens = checked["cu_seqlens"], checked
        lo, hi = int(rows[ref.row]), int(rows[ref.row + 1])
        columns["input_ids"].append(tokens["input_ids"][lo:hi].tolist())
        columns["loss_mask"].append(tokens["loss_mask"][lo:hi].tolist())
        columns["seq_len"].append(hi - lo)
    return columns
