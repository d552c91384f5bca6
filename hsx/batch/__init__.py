"""The batch-file format: the bytes of one batch (header, tensors, codec, dtypes) and their checks.

A header's metadata is a typed record, ``BatchMeta`` (a batch of hidden states) or ``InputsMeta`` (a batch's
inputs): every writer builds it and every reader parses it through hsx/batch/meta.py. The token columns'
digests, whole and per sample, are in hsx/batch/tokens.py; the hidden-state rows' per-sample CRC-32s in
hsx/batch/hidden.py.

Imports no other wing: not a run's spec or life, token preparation (`hsx.prep`) or a store (tests/test_house.py).
"""

# ruff: noqa: F401  (a face imports the names it offers: hsx/face.py)
from __future__ import annotations

from typing import TYPE_CHECKING

from hsx.batch.meta import (
    FORMAT,
    INCARNATION,
    INPUT_FORMAT,
    SAMPLE_HIDDEN_DIGESTS,
    SAMPLE_TOKEN_DIGESTS,
    TOKEN_DIGEST,
    BatchMeta,
    InputsMeta,
    read_meta,
)
from hsx.face import face

if TYPE_CHECKING:  # these modules import torch: loaded on first use (hsx/face.py)
    from hsx.batch.batchfile import (
        INPUT_DIGEST_MISMATCH,
        MAX_HEADER,
        BatchContents,
        BatchFileError,
        Header,
        TensorSpec,
        batch_bytes,
        decode_batch,
        decode_tensor,
        hidden_bytes_per_token,
        parse_header,
        read_batch_bytes,
        read_header,
        stored_bytes_per_token,
        stored_values,
        validate_batch,
        write_atomic,
    )
    from hsx.batch.codec import check_codec
    from hsx.batch.dtypes import FP8, VALUE_DTYPES, check_store_dtype, dtype_name, fp8_error, quantise_fp8
    from hsx.batch.hidden import HIDDEN_ROWS, sample_rows_crc32
    from hsx.batch.tokens import TOKEN_COLUMNS, columns_digest, sample_token_digest, token_digest

__getattr__, __dir__, __all__ = face(__name__, __file__)
