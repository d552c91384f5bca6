"""The batch-file format: the bytes of one batch (header, tensors, codec, dtypes) and their checks.

A header's metadata is a typed record, ``BatchMeta`` (a batch of hidden states) or ``InputsMeta`` (a batch's
inputs): every writer builds it and every reader parses it through hsx/batch/meta.py. The token columns'
digests, whole and per sample, are in hsx/batch/tokens.py.

Imports no other wing: not a run's spec or life, token preparation (`hsx.prep`) or a store (tests/test_house.py).
"""

from __future__ import annotations

from hsx.batch.batchfile import (
    INPUT_DIGEST_MISMATCH,
    MAX_HEADER,
    BatchContents,
    BatchFileError,
    Header,
    TensorSpec,
    decode_tensor,
    hidden_bytes_per_token,
    parse_header,
    read_header,
    stored_bytes_per_token,
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
from hsx.batch.meta import (
    FORMAT,
    INCARNATION,
    INPUT_FORMAT,
    SAMPLE_TOKEN_DIGESTS,
    TOKEN_DIGEST,
    BatchMeta,
    InputsMeta,
    read_meta,
)
from hsx.batch.tokens import TOKEN_COLUMNS, sample_token_digest, token_digest

__all__ = [
    "BatchContents",
    "BatchMeta",
    "INCARNATION",
    "InputsMeta",
    "SAMPLE_TOKEN_DIGESTS",
    "read_meta",
    "sample_token_digest",
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
