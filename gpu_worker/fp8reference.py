"""The reference linears of an FP8-compute model (what its decoder's linears compute without FP8 GEMMs),
and the comparison of FP8 outputs with the reference's.

Used once per run, for the one batch the compute error is measured on (hsx/life/computeerror.py):
``reference_linears(layers)`` swaps every :class:`~gpu_worker.fp8linear.Fp8Linear` under ``layers`` for a
:class:`DequantisedLinear` of the same weights and puts them back on exit. A model loaded from a bf16
checkpoint is measured before its linears are converted (gpu_worker/extractor.py), so it never needs this;
an FP8 checkpoint has no other weights than its e4m3 ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from gpu_worker.fp8linear import Fp8Linear


class DequantisedLinear(nn.Module):
    """``y = x @ (q * scale).T + b`` in ``x``'s dtype: the FP8 layer's weights, dequantised one layer at a
    time (a float32 copy of one weight at most), through an ordinary GEMM."""

    def __init__(self, fp8: Fp8Linear):
        super().__init__()
        self.fp8 = fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.fp8.bias.to(x.dtype) if self.fp8.bias is not None else None
        return nn.functional.linear(x, self.fp8.dequantised().to(x.dtype), bias)


@contextmanager
def reference_linears(layers: nn.Module) -> Iterator[int]:
    """Within the block, every Fp8Linear under ``layers`` is a DequantisedLinear; yields how many."""
    swaps = [(parent, name, child) for parent in layers.modules() for name, child in parent.named_children()
             if isinstance(child, Fp8Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, DequantisedLinear(child))
    try:
        yield len(swaps)
    finally:
        for parent, name, child in swaps:
            setattr(parent, name, child)


def compare(reference: torch.Tensor, x: torch.Tensor, n_layers: int) -> torch.Tensor:
    """[2, n] float32 on the device: per column block of ``H = width / n``, relative L2 of ``x`` against
    ``reference`` over all rows (``||x - ref|| / ||ref||``), and the mean over rows of their cosine. No host sync."""
    H = reference.shape[1] // n_layers
    out = torch.empty((2, n_layers), dtype=torch.float32, device=reference.device)
    for layer in range(n_layers):
        ref = reference[:, layer * H:(layer + 1) * H].float()
        got = x[:, layer * H:(layer + 1) * H].float()
        out[0, layer] = (got - ref).norm() / ref.norm().clamp(min=1e-30)
        out[1, layer] = torch.nn.functional.cosine_similarity(got, ref, dim=1, eps=1e-30).mean()
    return out
