"""The batch-file format: the bytes of one batch (header, tensors, codec, dtypes) and their checks.

Never imports run state (`hsx.run`), token preparation (`hsx.prep`) or a store (tests/test_house.py).
"""

from __future__ import annotations

from hsx.face import face

__getattr__, __dir__, __all__ = face(__name__, {
    "batchfile": {
        "FORMAT": None,
        "INPUT_DIGEST_MISMATCH": None,
        "INPUT_FORMAT": None,
        "MAX_HEADER": None,
        "TOKEN_COLUMNS": None,
        "TOKEN_DIGEST": None,
        "BatchContents": None,
        "BatchFileError": None,
        "Header": None,
        "TensorSpec": None,
        "decode_tensor": None,
        "hidden_bytes_per_token": None,
        "parse_header": None,
        "read_header": None,
        "stored_bytes_per_token": None,
        "token_digest": None,
        "write_atomic": None,
        "decode": "decode_batch",
        "read_bytes": "read_batch_bytes",
        "to_bytes": "batch_bytes",
        "validate": "validate_batch",
        "values": "stored_values",
    },
    "codec": ["check_codec"],
    "dtypes": ["FP8", "VALUE_DTYPES", "check_store_dtype", "dtype_name", "fp8_error", "quantise_fp8"],
})
