"""The per-layer elementwise ops on the GPU, one launch each: RMSNorm, SiLU-and-mul, rotary.

In torch each is a chain of small kernels (RMSNorm ~6, rotary ~10 per layer); at decode sizes every
launch costs a few µs whatever it moves, which made these ops ~3 ms of an 8B decode step's 8 ms on
the H200 (``benchmarks/gpu/bench_e2e.py``'s kernel breakdown), more than the attention.

Each kernel computes in fp32 and rounds to the storage dtype where the torch path (and HF) rounds.
Measured on the H200 in bf16 (tests/gpu/test_triton_elementwise.py): RMSNorm and SiLU-and-mul within
one bf16 step of the torch path; rotary off by one bf16 step of a product on ~2% of outputs (the
compiler evidently keeps a product unrounded: an FMA), relative error ~3e-3:

- RMSNorm: h = x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then times the weight,
  rounded to the result dtype of (weight, x) as ``weight * h.to(dtype)`` is.
- SiLU-and-mul: silu(gate) rounded to x's dtype, then times up, rounded.
- rotary (rotate-half layout): with cos/sin already in x's dtype, each product rounded, then the
  sum rounded (x1*cos - x2*sin, x2*cos + x1*sin); dims past rotary_dim copied.

Imported only on CUDA (or under TRITON_INTERPRET=1 in tests): CPU installs have no triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import tl_dtype


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    h = (x * (1.0 / tl.sqrt_rn(var + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape, last dim contiguous)."""
    N = x.shape[-1]
    assert weight.shape == (N,), f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), N, eps, BLOCK=block, num_warps=min(16, max(1, block // 256))
        )
    return out.view(*x.shape[:-1], N)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2d) -> (..., d): silu(x[..., :d]) * x[..., d:]."""
    D2 = x.shape[-1]
    assert D2 % 2 == 0, f"last dim {D2} is not even: silu_and_mul needs (gate, up) halves"
    D = D2 // 2
    x2 = x.reshape(-1, D2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], D, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(D))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(D, block))](
            x2, out, x2.stride(0), out.stride(0), D, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], D)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    HALF,
    D,
    ROT_BLOCK: tl.constexpr,
    REST_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + t * stride_xt + hd * stride_xh
    o_row = out_ptr + t * stride_ot + hd * stride_oh
    offs = tl.arange(0, ROT_BLOCK)
    mask = offs < HALF
    dt = out_ptr.dtype.element_ty
    x1 = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # cos/sin rows are cat(f, f): the first half serves both halves
    c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    a = (x1 * c).to(dt).to(tl.float32)
    b = (-x2 * s).to(dt).to(tl.float32)
    tl.store(o_row + offs, (a + b).to(dt), mask=mask)
    a = (x2 * c).to(dt).to(tl.float32)
    b = (x1 * s).to(dt).to(tl.float32)
    tl.store(o_row + HALF + offs, (a + b).to(dt), mask=mask)
    if REST_BLOCK > 0:
        r = 2 * HALF + tl.arange(0, REST_BLOCK)
        rmask = r < D
        tl.store(o_row + r, tl.load(x_row + r, mask=rmask, other=0.0), mask=rmask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, rotary_dim) in x's dtype (rows cat(f, f)); a new tensor."""
    T, H, D = x.shape
    rd = cos.shape[-1]
    assert cos.shape == sin.shape == (T, rd) and rd % 2 == 0 and rd <= D, (
        f"cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}"
    )
    assert cos.dtype == x.dtype and cos.stride(-1) == 1 and sin.stride() == cos.stride(), "cos/sin: x's dtype, rows"
    tl_dtype(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        half = rd // 2
        rest = D - rd
        _rotary_kernel[(T, H)](
            x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), half, D,
            ROT_BLOCK=triton.next_power_of_2(half), REST_BLOCK=triton.next_power_of_2(rest) if rest else 0,
            num_warps=1,
        )  # fmt: skip
    return out
