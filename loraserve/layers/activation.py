"""Gated activations."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

_HAS_TRITON = importlib.util.find_spec("triton") is not None


class SiluAndMul(nn.Module):
    """(..., 2d) -> (..., d): silu(x[..., :d]) * x[..., d:]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and _HAS_TRITON:  # one launch instead of two (same roundings)
            from loraserve.layers.triton_elementwise import silu_and_mul

            return silu_and_mul(x)
        return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The reference; the Triton kernel is checked against it."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
