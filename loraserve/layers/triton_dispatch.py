"""Which tensors take the Triton kernels: CUDA tensors, with triton installed (CPU installs have none).

One place for the check the per-layer ops make on every call, and for the lazy import of the
elementwise kernels (resolved once, not per call: these ops run several times per layer per step).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def on_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda


@functools.cache
def decode_linear_kernels():
    """``layers/triton_decode_linear`` (imports triton: only call it for tensors where ``on_triton``)."""
    from loraserve.layers import triton_decode_linear

    return triton_decode_linear


@functools.cache
def elementwise_kernels():
    """``layers/triton_elementwise`` (imports triton: only call it for tensors where ``on_triton``)."""
    from loraserve.layers import triton_elementwise

    return triton_elementwise
