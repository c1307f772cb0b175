"""Small helpers shared by the Triton LoRA kernels."""

from __future__ import annotations

import torch
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype):
    if dtype not in _TL:
        raise TypeError(f"LoRA kernels take float32, bfloat16 or float16 tensors, got {dtype}")
    return _TL[dtype]


def compute_dtype_of(x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype the product runs in, as the torch reference does it: x is cast to the weight's dtype.

    NOTE: fp32 weights (the default: PEFT upcasts adapters) multiply in true fp32 (no tf32), as the
    reference's fp32 matmul does; half-precision weights use the tensor cores with fp32 accumulation.
    """
    tl_dtype(x_dtype)
    tl_dtype(w_dtype)
    return w_dtype
