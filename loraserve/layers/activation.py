"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.layers.triton_dispatch import elementwise_kernels, on_triton


class SiluAndMul(nn.Module):
    """(..., 2d) -> (..., d): silu(x[..., :d]) * x[..., d:]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_triton(x):  # one launch instead of two (same roundings)
            return elementwise_kernels().silu_and_mul(x)
        return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference; the Triton kernel is checked against it."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
