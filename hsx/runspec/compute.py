"""What a run computes in: the target's compute dtype and FP8 accumulation, checked when a run is planned.

The FP8 kernels themselves are the GPU worker's (gpu_worker/fp8compute.py, gpu_worker/fp8linear.py).
"""

from __future__ import annotations

from hsx.defaults import COMPUTE_DTYPES, DEFAULT_FP8_ACCUMULATION, FP8_ACCUMULATIONS
from hsx.errors import HsxError


class ComputeDtypeError(HsxError, ValueError):
    """FP8 compute asked where it cannot run, or an unknown compute dtype."""


def check_compute_dtype(name: str) -> str:
    if name not in COMPUTE_DTYPES:
        raise ComputeDtypeError(f"compute dtype {name!r}: use one of {', '.join(COMPUTE_DTYPES)}")
    return name


def check_fp8_accumulation(name: str, compute_dtype: str) -> str:
    """``name`` if it is one; "fast" only with float8 compute (bf16 GEMMs have no such choice)."""
    if name not in FP8_ACCUMULATIONS:
        raise ComputeDtypeError(f"FP8 accumulation {name!r}: use one of {', '.join(FP8_ACCUMULATIONS)}")
    if name != DEFAULT_FP8_ACCUMULATION and compute_dtype != "float8":
        raise ComputeDtypeError(f"--fp8-accumulation {name} applies to --compute-dtype float8 only; this run computes "
                                f"in {compute_dtype}")
    return name
