"""Dtypes, in one table: the names runs use, torch's dtypes, safetensors' codes; FP8 with scales.

A run has two dtypes (both in the manifest):
- ``dtype``: what readers get back (bfloat16 by default; float32 on a CPU demo);
- ``store_dtype``: what the batch files hold. The same as ``dtype``, or ``float8_e4m3``:
  float8_e4m3fn values with one float32 scale per token per layer,
  ``value = fp8 * scale``, ``scale = max|x| / 448`` over that token's H channels of that layer.
"""

from __future__ import annotations

import torch

from hsx.defaults import STORE_DTYPES

VALUE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8 = "float8_e4m3"
assert STORE_DTYPES == (*VALUE_DTYPES, FP8)
FP8_TORCH = torch.float8_e4m3fn
FP8_MAX = 448.0            # largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12      # an all-zero row keeps a positive scale

# torch dtype <-> safetensors' dtype code, for every tensor a batch file may hold.
ST_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", FP8_TORCH: "F8_E4M3",
            torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}
ST_TORCH = {code: dtype for dtype, code in ST_CODES.items()}


def value_dtype(name: str) -> torch.dtype:
    if name not in VALUE_DTYPES:
        raise ValueError(f"dtype {name!r} is not one hsx computes ({', '.join(VALUE_DTYPES)})")
    return VALUE_DTYPES[name]


def check_store_dtype(name: str) -> str:
    if name not in STORE_DTYPES:
        raise ValueError(f"store dtype {name!r}: use one of {', '.join(STORE_DTYPES)}")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    names = {v: k for k, v in VALUE_DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype {dtype} is not one hsx stores ({', '.join(VALUE_DTYPES)})")
    return names[dtype]


def store_itemsize(store_dtype: str) -> int:
    """Bytes a hidden-state value takes in a batch file (before any codec)."""
    return 1 if store_dtype == FP8 else VALUE_DTYPES[store_dtype].itemsize


def quantise_fp8(x: torch.Tensor, n_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, n*H] (any float dtype, any device) -> (fp8 [N, n*H], scales [N, n] float32), on x's device.

    One layer at a time, so the float32 temporary is [N, H], not [N, n*H].
    """
    N, width = x.shape
    H = width // n_layers
    q = torch.empty((N, width), dtype=FP8_TORCH, device=x.device)
    scales = torch.empty((N, n_layers), dtype=torch.float32, device=x.device)
    for layer in range(n_layers):
        block = x[:, layer * H:(layer + 1) * H].float()  # a view when x is float32: never written
        scale = block.abs().amax(dim=1, keepdim=True).div_(FP8_MAX).clamp_(min=FP8_MIN_SCALE)
        q[:, layer * H:(layer + 1) * H] = (block / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_TORCH)
        scales[:, layer] = scale.squeeze(1)
    return q, scales


def dequantise_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [N, n*H] + scales [N, n] -> [N, n*H] in ``dtype`` (computed in float32)."""
    N, width = q.shape
    n_layers = scales.shape[1]
    out = q.float().view(N, n_layers, width // n_layers).mul_(scales.float().unsqueeze(2))
    return out.view(N, width).to(dtype)


def fp8_error(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[2, n] float32 on x's device: per layer, relative L2 ||deq - x|| / ||x|| over the batch, and the
    mean over tokens of cosine(deq, x). No host sync: the caller copies it with the batch."""
    N, width = x.shape
    n_layers = scales.shape[1]
    H = width // n_layers
    out = torch.empty((2, n_layers), dtype=torch.float32, device=x.device)
    for layer in range(n_layers):
        ref = x[:, layer * H:(layer + 1) * H].float()
        deq = q[:, layer * H:(layer + 1) * H].float().mul_(scales[:, layer:layer + 1])
        out[0, layer] = (deq - ref).norm() / ref.norm().clamp(min=1e-30)
        out[1, layer] = torch.nn.functional.cosine_similarity(deq, ref, dim=1, eps=1e-30).mean()
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a file stores them (a view: no copy of a contiguous tensor)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
