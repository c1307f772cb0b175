"""Reference LoRA ops: the CPU backend and the oracle for the GPU kernels.

Tokens arrive grouped by slot as ``segments``: (slot, token indices) for each active slot, so every
op is one matmul per active adapter, sized by that adapter's own rank (``ranks[slot]``), never
max_lora_rank. Accumulation is fp32. Stacked weights follow the seeds' layout:
A ``(max_loras, 1, max_rank, in)``, B ``(max_loras, 1, out, max_rank)``.
"""

from __future__ import annotations

import torch

from loraserve.lora.ops.precision import compute_dtype

Segments = list[tuple[int, torch.Tensor]]


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
        out[idx, :r] = (x[idx].to(cdt) @ a.to(cdt).t()).to(out.dtype)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: torch.Tensor,
    segments: Segments,
    ranks: list[int],
    offset: int = 0,
    act_dtype: torch.dtype = torch.float32,
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
        y[idx, offset : offset + n] += (buf[idx, :r].to(cdt) @ b.to(cdt).t()).to(y.dtype)


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
        y[idx] += (rows @ lora_b[slot, 0, :, :r].t()).to(y.dtype)
