"""What a batch file's header must say before any of its tensors is read or decompressed.

``hsx.batch.batchfile.parse_header`` calls ``check_header``; every problem is a
ValueError there, which the decoder reports as the one BatchFileError (the
reader's CorruptBatch) naming the object. The checks need only the header, so
a crafted object is refused before a byte of it is allocated: the declared
shape of a compressed tensor is the bound of its decompression, and that
shape is pinned here to the token count that the raw ``input_ids`` bytes
back, and to the run's width where the header names it.
"""

from __future__ import annotations

import torch

from hsx.batch.dtypes import FP8_TORCH, VALUE_DTYPES
from hsx.batch.meta import BatchMeta

# The dtype and rank each tensor of the format must have (hidden states: any value dtype or FP8).
_FIXED = {"input_ids": (torch.int32, 1), "loss_mask": (torch.uint8, 1), "cu_seqlens": (torch.int64, 1),
          "hidden_scales": (torch.float32, 2), "final_scales": (torch.float32, 2)}
_HIDDEN = ("hidden_states", "final_hidden_states")
_HIDDEN_DTYPES = (*VALUE_DTYPES.values(), FP8_TORCH)


def check_shape(name: str, shape) -> tuple[int, ...]:
    """A declared shape as a tuple of non-negative ints."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    return tuple(shape)


def check_offsets(name: str, offsets) -> tuple[int, int]:
    """A tensor's [start, end) data offsets: two integers, 0 <= start <= end."""
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise ValueError(f"tensor {name!r}: data_offsets {str(offsets)[:80]} are not [start, end] with 0 <= start <= end")
    return offsets[0], offsets[1]


def check_planes(name: str, planes, stored_bytes: int) -> None:
    """The plane table of an encoded tensor: [[codec, bytes], ...] adding up to its stored bytes."""
    if planes is None:
        return
    if (not isinstance(planes, list)
            or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int)
                       and not isinstance(p[1], bool) and p[1] >= 0 for p in planes)
            or sum(p[1] for p in planes) != stored_bytes):
        raise ValueError(f"tensor {name!r}: plane table {str(planes)[:80]} is not [[codec, bytes], ...] adding up "
                         f"to its {stored_bytes} stored bytes")


def check_header(header) -> None:
    """Raise ValueError unless ``header`` (an hsx.batch.batchfile.Header) describes a well-formed batch.

    Its metadata fields are already parsed (``header.meta``, hsx/batch/meta.py, which refuses a malformed one).
    """
    for name, (dtype, ndim) in _FIXED.items():
        if header.has(name):
            got, shape = header.stored(name)
            if got != dtype or len(shape) != ndim:
                raise ValueError(f"tensor {name!r} is {got} {list(shape)}, the format wants {dtype} of rank {ndim}")
    if not all(header.has(n) for n in ("input_ids", "loss_mask", "cu_seqlens")):
        return  # parse_header names the missing tensor
    n_tokens = header.stored("input_ids")[1][0]
    meta = header.meta if isinstance(header.meta, BatchMeta) else None   # an inputs file declares no width
    width = meta.width if meta else None
    if width is None and any(n in header.encoding for n in _HIDDEN):
        # Raw tensors are backed by the object's bytes; a compressed one only by what the header claims.
        raise ValueError("compressed hidden states without layer_ids and hidden_size in __metadata__ (the size "
                         "they decompress to would be unchecked)")
    spans = sorted((t.start, t.end, name) for name, t in header.tensors.items())
    for (_, end, name), (start, _, later) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ValueError(f"tensors {name!r} and {later!r} overlap")
    for name in (*_HIDDEN, "hidden_scales", "final_scales"):
        if not header.has(name):
            continue
        dtype, shape = header.stored(name)
        if name in _HIDDEN and dtype not in _HIDDEN_DTYPES:
            raise ValueError(f"tensor {name!r} is {dtype}; hidden states are bfloat16, float16, float32 or FP8")
        if len(shape) != 2 or shape[0] != n_tokens:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}, want [{n_tokens}, ...] ({n_tokens} tokens "
                             "in input_ids)")
        want = width if name == "hidden_states" else None
        if name == "final_hidden_states" and meta and meta.hidden_size is not None:
            want = meta.hidden_size
        if want is not None and shape[1] != want:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}, the header's layer_ids x hidden_size say "
                             f"[{n_tokens}, {want}]")
    if header.has("loss_mask") and header.stored("loss_mask")[1][0] != n_tokens:
        raise ValueError(f"loss_mask has {header.stored('loss_mask')[1][0]} tokens, input_ids {n_tokens}")
