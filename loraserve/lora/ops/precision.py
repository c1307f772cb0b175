"""The LoRA numerics shared by the torch reference and the kernels: which dtype a product runs in, and
how LoRA weights are stored in fp16 without losing what the GPU's products use of fp32.

Products (``compute_dtype``): the activations (x for A, s for B: the layer's input dtype names both)
are cast to the weights' dtype, with fp32 accumulation, except where that would lose bits:
- fp32 weights: fp32 products (tf32 on the tensor cores with half-precision activations);
- bf16 activations with fp16 weights (or the reverse): fp32 (tf32), not either half: tf32 keeps 10
  mantissa bits and fp32's exponent range, so the product of a bf16 value (7 bits) and an fp16 value
  (10 bits) is exact; casting x to fp16 could overflow (|x| > 65504) and casting to bf16 would drop 3
  bits of every weight. s stays fp32 into its product (no rounding to the weights' dtype). (The GPU's
  prefill shrink reaches the same exact products in fp16 MMAs: x cast to fp16, exact inside
  [2^-17, 65504], a block with an x past 65504 redone in tf32; ``triton/lora_shrink.py``, ``x_dot``.)

Storage (``balance_to_fp16``): a GPU LoRA product with fp32 weights and half-precision activations is
tf32, which reads 10 mantissa bits of each weight, what fp16 holds. fp16's range is what differs
(normal down to 2^-14, at most 65504). B A is unchanged when row i of A is multiplied by a power of
two 2^e_i and column i of B by 2^-e_i (exactly, in floating point): picking e_i so both maxima land
on sqrt(max|A_i| * max|B_i|) stores every pair whose rank-i scale fits fp16, so fp16 storage keeps
the bits the tf32 products use in half of fp32's bytes. ``LoRAConfig.lora_dtype="auto"`` stores fp16
on the GPU for bf16 models (their products were tf32); fp32 elsewhere.
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)
MIXED_HALVES_IN_FP32 = True  # a knob: False multiplies bf16 x with fp16 weights in fp16 (benchmarks only)


def compute_dtype(act_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype the product of activations of ``act_dtype`` with LoRA weights of ``w_dtype`` runs in
    (the module docstring). fp32 accumulation always."""
    if w_dtype == torch.float32:
        return torch.float32
    if MIXED_HALVES_IN_FP32 and act_dtype in HALF and act_dtype != w_dtype:
        return torch.float32
    return w_dtype


FP16_MAX = 65504.0


def balance_to_fp16(a: torch.Tensor, b: torch.Tensor, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (..., r, in) and B (..., out, r) -> fp16 copies whose product B A is the same: rank row i of A
    times 2^e_i, column i of B times 2^-e_i, both maxima near sqrt(max|A_i| max|B_i|). Leading dims
    (MoE experts) balance separately. A rank whose row of A or column of B is all zeros adds nothing
    and is stored as zeros (a finite A row times a zero column could still overflow to inf * 0 = NaN).

    Raises ValueError naming ``where`` when a rank's scale is beyond fp16 (max|A_i| max|B_i| > ~2^31):
    such an adapter needs ``--lora-dtype float32``, as does one holding NaN or inf (refused as broken).
    Values below fp16's smallest normal (2^-14) after balancing are subnormals, rounded to multiples of
    2^-24: they keep fewer than 10 bits. That is most of a rank's values only when its scale
    sqrt(max|A_i| max|B_i|) nears 2^-14 (B ~1e-7 with A ~1e-2), and such a rank's term is that small too.
    """
    a32, b32 = a.float(), b.float()
    amax = a32.abs().amax(dim=-1)  # (..., r)
    bmax = b32.abs().amax(dim=-2)  # (..., r)
    if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
        raise ValueError(f"{where}: the LoRA weights hold NaN or inf; the adapter file is broken")
    live = (amax > 0) & (bmax > 0)
    # 2^e ~ sqrt(bmax / amax), from the logs: the ratio itself overflows fp32 for a near-dead rank
    e = torch.where(live, torch.round(0.5 * (torch.log2(bmax) - torch.log2(amax))), 0.0)
    a16 = torch.where(live[..., :, None], torch.ldexp(a32, e[..., :, None]), 0.0)
    b16 = torch.where(live[..., None, :], torch.ldexp(b32, -e[..., None, :]), 0.0)
    worst = max(a16.abs().amax().item(), b16.abs().amax().item()) if a16.numel() and b16.numel() else 0.0
    if not worst < FP16_MAX:  # (NaN fails too)
        raise ValueError(
            f"{where}: LoRA weights beyond fp16 storage (a rank's balanced maximum is {worst:.3g}, fp16 holds "
            f"{FP16_MAX:g}); serve this adapter with --lora-dtype float32"
        )
    return a16.to(torch.float16), b16.to(torch.float16)


def exact_pieces(a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``a`` as pieces of ``dtype`` that sum to it: one (a itself) where a already is ``dtype``, else two,
    hi = a rounded to ``dtype`` and lo = what that rounding lost, rounded. Exact for fp16 in bf16 pieces (11
    significant bits = hi's 8 + at most 3, and bf16 has fp16's range and more); fp32 keeps 16 of its 24 bits
    (more than the 10 tf32 products read). Products of half-precision pieces with half-precision x are exact
    in fp32, so x @ hi^T + x @ lo^T is x @ a^T to within fp32 sums: how a half-precision GEMM computes a
    shrink with another dtype's A (``row_delta``'s shrink in the GEMM)."""
    if a.dtype == dtype:
        return (a,)
    hi = a.to(dtype)
    return hi, (a.float() - hi.float()).to(dtype)


def to_storage(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B (fp32, scale folded into B) in the LoRA storage dtype, contiguous: fp16 balanced
    (``balance_to_fp16``), other dtypes cast."""
    if dtype == torch.float16:
        a, b = balance_to_fp16(a, b, where)
        return a.contiguous(), b.contiguous()
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()
