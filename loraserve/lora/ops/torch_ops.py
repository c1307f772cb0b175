"""Reference LoRA ops: the CPU backend and the oracle for the GPU kernels.

Tokens arrive grouped by slot as ``segments``: (slot, token indices) for each active slot, so every
op is one matmul per active adapter, sized by that adapter's own rank (``ranks[slot]``), never
max_lora_rank. Operands are rounded to ``precision.compute_dtype``'s dtype; products and sums are fp32
(as the tensor cores'), and results are not rounded to a half dtype. Stacked weights follow the seeds' layout:
A ``(max_loras, 1, max_rank, in)``, B ``(max_loras, 1, out, max_rank)``.
"""

from __future__ import annotations

import torch

from loraserve.lora.ops.precision import compute_dtype

Segments = list[tuple[int, torch.Tensor]]


def matmul_t(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """a @ b^T with both rounded to ``cdt``, the products and their sum in fp32: what the GPU's tensor cores
    do (a product of two half-precision values is exact in fp32), with no rounding of the result to cdt."""
    return a.to(cdt).float() @ b.to(cdt).float().t()


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, segments: Segments, ranks: list[int], out: torch.Tensor
) -> None:
    """out[t, :r] = x[t] @ A[slot(t), :r]^T for tokens with a slot. x (T, in), out (T, R) fp32."""
    for slot, idx in segments:
        r = ranks[slot]
        if r == 0:
            continue
        a = lora_a[slot, 0, :r]  # (r, in)
        cdt = compute_dtype(x.dtype, a.dtype)
        out[idx, :r] = matmul_t(x[idx], a, cdt).to(out.dtype)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Segments,
    ranks: list[int],
    offset: int = 0,
    *,
    act_dtype: torch.dtype,
) -> None:
    """y[t, offset:offset+out] += buf[t, :r] @ B[slot(t), :, :r]^T. y fp32 (T, N), buf (T, R). The product runs
    in ``compute_dtype(act_dtype, B's dtype)``, act_dtype being the layer's input dtype (x of the shrink)."""
    n = lora_b.shape[2]
    for slot, idx in segments:
        r = ranks[slot]
        if r == 0:
            continue
        b = lora_b[slot, 0, :, :r]  # (out, r)
        cdt = compute_dtype(act_dtype, b.dtype)
        y[idx, offset : offset + n] += matmul_t(buf[idx, :r], b, cdt).to(y.dtype)


def lora_embedding(
    y: torch.Tensor,
    ids: torch.Tensor,
    emb_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Segments,
    ranks: list[int],
) -> None:
    """y[t] += A^T[ids[t]] @ B^T for embedding LoRA. emb_a (max_loras, V, max_rank), lora_b (max_loras, 1, H, R)."""
    for slot, idx in segments:
        r = ranks[slot]
        if r == 0:
            continue
        rows = emb_a[slot, :, :r][ids[idx]]  # (n, r)
        b = lora_b[slot, 0, :, :r]
        y[idx] += matmul_t(rows, b, compute_dtype(rows.dtype, b.dtype)).to(y.dtype)
