"""RMSNorm, computed as HF does: in fp32, weight applied after casting back."""

from __future__ import annotations

import torch
from torch import nn

from loraserve.forward_context import take_deferred_delta
from loraserve.layers.triton_dispatch import elementwise_kernels, on_triton


class RMSNorm(nn.Module):
    """``norm(x)`` -> RMSNorm(x); ``norm(x, residual)`` -> (RMSNorm(x + residual), x + residual).

    The second form is the decoder's residual stream (vLLM's ``fused_add_rms_norm``): the sum is
    torch's ``x + residual`` (fp32 add, one rounding to the dtype) and the norm reads that rounded sum,
    so it equals ``h = x + residual; norm(h)`` bit for bit. On the GPU it is one Triton launch
    instead of an add plus a norm; x and residual are left untouched (both results are new tensors).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, feeds: nn.Module | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``feeds``: the layer that takes this norm's output as its input, if the caller knows it. A layer
        with a ``fuse_norm(x, residual, weight, eps, delta)`` method may compute the norm itself, with work of
        its own in the same launch (a LoRA'd projection's shrink); it returns what this method would, or
        None, and then the norm runs here.

        x may carry a LoRA delta its projection left to this norm (``take_deferred_delta``: a row-parallel
        projection marked ``output_feeds_norm``, ``row_delta``): it is added to x first, in the launch where
        the kernel takes it (the residual add's), else here in torch."""
        delta = take_deferred_delta(x)
        in_kernel = delta is not None and residual is not None and on_triton(x)
        if delta is not None and not in_kernel:
            x, delta = delta.add_to(x), None
        if feeds is not None and on_triton(x):
            fuse_norm = getattr(feeds, "fuse_norm", None)
            fused = fuse_norm(x, residual, self.weight, self.eps, delta=delta) if fuse_norm is not None else None
            if fused is not None:
                return fused
        if residual is not None:
            if on_triton(x):  # one launch for the add and the norm (same roundings)
                return elementwise_kernels().fused_add_rms_norm(x, residual, self.weight, self.eps, delta=delta)
            h = x + residual
            return self.forward(h), h
        if on_triton(x):  # one launch instead of ~6 (same roundings: triton_elementwise.py)
            return elementwise_kernels().rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference (HF's formula); the Triton kernel is checked against it."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
