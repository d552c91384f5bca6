"""The batch-file format: the bytes of one batch (header, tensors, codec, dtypes) and their checks.

A header's metadata is a typed record, ``BatchMeta`` (a batch of hidden states) or ``InputsMeta`` (a batch's
inputs): every writer builds it and every reader parses it through hsx/batch/meta.py. The token columns'
digests, whole and per sample, are in hsx/batch/tokens.py; the hidden-state rows' per-sample CRC-32s in
hsx/batch/hidden.py.

Imports no other wing: not a run's spec or life, token preparation (`hsx.prep`) or a store (tests/test_house.py).
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "batchfile": {
        "INPUT_DIGEST_MISMATCH": None,
        "MAX_HEADER": None,
        "BatchContents": None,
        "BatchFileError": None,
        "Header": None,
        "TensorSpec": None,
        "decode_tensor": None,
        "hidden_bytes_per_token": None,
        "parse_header": None,
        "read_header": None,
        "stored_bytes_per_token": None,
        "write_atomic": None,
        "decode": "decode_batch",
        "read_bytes": "read_batch_bytes",
        "to_bytes": "batch_bytes",
        "validate": "validate_batch",
        "values": "stored_values",
    },
    "meta": ["FORMAT", "INCARNATION", "INPUT_FORMAT", "SAMPLE_HIDDEN_DIGESTS", "SAMPLE_TOKEN_DIGESTS", "TOKEN_DIGEST",
             "BatchMeta", "InputsMeta", "read_meta"],
    "tokens": ["TOKEN_COLUMNS", "columns_digest", "sample_token_digest", "token_digest"],
    "hidden": ["HIDDEN_ROWS", "sample_rows_crc32"],
    "codec": ["check_codec"],
    "dtypes": ["FP8", "VALUE_DTYPES", "check_store_dtype", "dtype_name", "fp8_error", "quantise_fp8"],
})
