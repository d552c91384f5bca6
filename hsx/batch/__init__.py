"""The batch-file format: the bytes of one batch (header, tensors, codec, dtypes) and their checks.

Never imports run state (`hsx.run`), token preparation (`hsx.prep`) or a store (tests/test_house.py).
"""

from __future__ import annotations

from hsx.batch.batchfile import (
    FORMAT,
    INPUT_DIGEST_MISMATCH,
    INPUT_FORMAT,
    MAX_HEADER,
    TOKEN_COLUMNS,
    TOKEN_DIGEST,
    BatchContents,
    BatchFileError,
    Header,
    TensorSpec,
    decode_tensor,
    hidden_bytes_per_token,
    parse_header,
    read_header,
    stored_bytes_per_token,
    token_digest,
    write_atomic,
)
from hsx.batch.batchfile import (
    decode as decode_batch,
)
from hsx.batch.batchfile import (
    read_bytes as read_batch_bytes,
)
from hsx.batch.batchfile import (
    to_bytes as batch_bytes,
)
from hsx.batch.batchfile import (
    validate as validate_batch,
)
from hsx.batch.batchfile import (
    values as stored_values,
)
from hsx.batch.codec import check_codec
from hsx.batch.dtypes import FP8, VALUE_DTYPES, check_store_dtype, dtype_name, fp8_error, quantise_fp8

__all__ = [
    "BatchContents",
    "BatchFileError",
    "FORMAT",
    "Header",
    "INPUT_DIGEST_MISMATCH",
    "INPUT_FORMAT",
    "MAX_HEADER",
    "TOKEN_COLUMNS",
    "TOKEN_DIGEST",
    "TensorSpec",
    "batch_bytes",
    "decode_batch",
    "decode_tensor",
    "hidden_bytes_per_token",
    "parse_header",
    "read_batch_bytes",
    "read_header",
    "stored_bytes_per_token",
    "stored_values",
    "token_digest",
    "validate_batch",
    "write_atomic",
    "FP8",
    "VALUE_DTYPES",
    "check_store_dtype",
    "dtype_name",
    "fp8_error",
    "quantise_fp8",
    "check_codec",
]
