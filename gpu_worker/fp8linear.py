"""The target's linear layers as rowwise-scaled e4m3 GEMMs (``hsx produce --compute-dtype float8``).

An :class:`Fp8Linear` holds float8_e4m3fn weights with one float32 scale per output row; its input is
quantised per row (per token) on the fly and one ``torch._scaled_mm`` gives bf16 out. Where the FP8 GEMM
is 2x the bf16 one, everything around it decides the speed-up, so:

- the activation is quantised in one pass (a Triton kernel on a GPU: amax of the row, scale, cast), and
  once per tensor: linears that read the same activation (q/k/v, gate/up, a Gated DeltaNet's in_proj_*)
  share its quantised form (:func:`quantised_input`, keyed by the activation's identity);
- the GEMM accumulates in fp32 by default (``fast_accum=False``: the tensor cores' partial sums are promoted
  to fp32 at intervals); ``--fp8-accumulation fast`` keeps them in the tensor cores' reduced-precision
  accumulator: ~3 % faster, ~35 % more error on trained weights (docs/benchmarks.md).

Measured on an H200 (docs/benchmarks.md): the quantiser compiled by ``torch.compile`` took 13 % of the FP8
forward, the Triton one 3 %; one GEMM over the siblings' concatenated weights was slower than separate ones.

The CPU runs the same layers with the reference quantiser (tests; torch's CPU ``_scaled_mm``).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
MIN_FEATURES = 16      # _scaled_mm needs both GEMM dimensions a multiple of 16
QUANTISER = "triton"   # "triton" (one pass) | "compile" (torch.compile'd reference) | "eager"
SHARE_INPUTS = True    # linears reading one activation quantise it once

def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale [rows, 1]) with ``x ~= q * scale`` per row: the reference."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# ---- activation quantisation on the GPU ------------------------------------------
_kernel = None
_compiled = None


def _triton_kernel():
    """One program a row: amax over the row (one block, or a loop of blocks for wide rows), then scale and
    cast; 2 bytes read (once more from L2 for wide rows) and 1 byte + a scale written per element."""
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def quantise_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, x_stride, q_stride,
                                 BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            x_row, q_row = x_ptr + row * x_stride, q_ptr + row * q_stride
            offs = tl.arange(0, BLOCK)
            if ONE_BLOCK:
                mask = offs < n_cols
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
                q = tl.clamp(x / scale, -448.0, 448.0)
                tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
            else:
                amax = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, n_cols, BLOCK):
                    mask = start + offs < n_cols
                    x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(x))
                scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
                for start in range(0, n_cols, BLOCK):
                    mask = start + offs < n_cols
                    x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
                    q = tl.clamp(x / scale, -448.0, 448.0)
                    tl.store(q_row + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + row, scale)

        _kernel = (triton, quantise_rows_kernel)
    return _kernel


def _quantise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    triton, kernel = _triton_kernel()
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = min(triton.next_power_of_2(cols), 8192)
        kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block, ONE_BLOCK=cols <= block,
                        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16)
    return q, scale


def quantise_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantise_rows`` of a GEMM's input [rows, cols]: one Triton pass on a GPU, the reference on the CPU."""
    global _compiled
    if not x.is_cuda or QUANTISER == "eager":
        return quantise_rows(x)
    if QUANTISER == "compile":
        if _compiled is None:
            _compiled = torch.compile(quantise_rows, dynamic=True, fullgraph=True)
        return _compiled(x)
    return _quantise_triton(x)


class _LastInput(threading.local):
    """The last activation quantised (a weak reference) and its quantised form, per thread."""

    ref = None
    q = scale = None


_last = _LastInput()


def quantised_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [rows, cols], scale [rows, 1]) of ``x`` [..., cols]; the same tensor object asked for again (the
    next sibling linear) gets the same quantised form. Identity, not contents: transformers' layers pass one
    tensor to the siblings and never change it in place in between."""
    if SHARE_INPUTS and _last.ref is not None and _last.ref() is x:
        return _last.q, _last.scale
    _last.ref = _last.q = _last.scale = None   # free the last one before allocating the next
    q, scale = quantise_activations(x.reshape(-1, x.shape[-1]))
    if SHARE_INPUTS:
        _last.ref, _last.q, _last.scale = weakref.ref(x), q, scale
    return q, scale


def scaled_mm(xq, xs, weight, weight_scale, bias, out_dtype, fast_accum: bool) -> torch.Tensor:
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.t(), bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` as one rowwise-scaled e4m3 GEMM; W held in e4m3 with a float32 scale per row."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype = torch.bfloat16, fast_accum: bool = False):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("weight", qweight)
        self.register_buffer("weight_scale", scale.float().reshape(-1, 1))
        self.bias = nn.Parameter(bias.to(out_dtype), requires_grad=False) if bias is not None else None
        self.out_dtype = out_dtype
        self.fast_accum = fast_accum   # True: the tensor cores' fast accumulation, no promotion to fp32

    @classmethod
    def of(cls, linear: nn.Linear, fast_accum: bool = False) -> Fp8Linear:
        q, scale = quantise_rows(linear.weight.data)
        return cls(q, scale, linear.bias.data if linear.bias is not None else None, linear.weight.dtype, fast_accum)

    def dequantised(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantised_input(x)
        y = scaled_mm(xq, xs, self.weight, self.weight_scale, self.bias, self.out_dtype, self.fast_accum)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        accumulation = "fast" if self.fast_accum else "fp32"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 rowwise, {accumulation} accumulation"


def _convertible(linear: nn.Linear, min_features: int) -> bool:
    o, i = linear.weight.shape
    return min(o, i) >= min_features and o % 16 == 0 and i % 16 == 0


def convert_linears(layers: nn.Module, fast_accum: bool = False, min_features: int = MIN_FEATURES) -> int:
    """Replace every convertible ``nn.Linear`` under ``layers`` by an Fp8Linear (accumulating fast or in fp32),
    in place; how many."""
    swaps = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and _convertible(child, min_features)]
    for parent, name, child in swaps:
        setattr(parent, name, Fp8Linear.of(child, fast_accum))
        del child
    return len(swaps)
