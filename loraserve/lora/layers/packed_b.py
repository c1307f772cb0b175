"""Every slot's B laid out as extra K columns of the layer's GEMM, for ``decode_linear`` (GPU, decode sizes).

At decode sizes a LoRA'd linear layer runs as ONE GEMM over K + P*S*R columns (S slots of rank R):

    y = [x | s | s] @ [W | B_hi | B_lo]^T,      s[t, j*R + r] = (x A_j^T)[t, r] if slot(t) == j else 0

so the slots' B stream through the GEMM's pipelined K loop like more columns of W, and the delta costs
its bytes, not a round trip after the loop. This module keeps that layout, (N, P, S, R) in the
activation dtype, in step with ``lora_b_stacked`` (a layer calls ``write_slot`` whenever it writes or
clears a slot; ``lora_b_stacked`` stays the storage every other path reads).

P = 1 when B is stored in the activation dtype (bf16 LoRA weights). P = 2 when it is fp32 (PEFT's dtype,
the default): B = hi + lo with hi = B rounded to bf16 and lo = (B - hi) rounded to bf16, which keeps 16
bits of B's mantissa (tf32 keeps 10), for the same bytes as fp32.
"""

from __future__ import annotations

import torch


def planes_for(b_dtype: torch.dtype, act_dtype: torch.dtype) -> int:
    """1 where B already is in the activation dtype, else 2 (hi + lo)."""
    return 1 if b_dtype == act_dtype else 2


def _slot_planes(b: torch.Tensor, act_dtype: torch.dtype, planes: int) -> torch.Tensor:
    """b (..., N, R) -> (..., N, planes, R) in act_dtype: [B] or [hi, lo]."""
    hi = b.to(act_dtype)
    if planes == 1:
        return hi.unsqueeze(-2)
    lo = (b.float() - hi.float()).to(act_dtype)
    return torch.stack((hi, lo), dim=-2)


def pack_b(lora_b_stacked: tuple[torch.Tensor, ...], act_dtype: torch.dtype) -> torch.Tensor:
    """(N, P, S, R) contiguous: per slice (S, 1, N_i, R) of B, rows of the slices in order."""
    b0 = lora_b_stacked[0]
    S, R = b0.shape[0], b0.shape[3]
    planes = planes_for(b0.dtype, act_dtype)
    N = sum(b.shape[2] for b in lora_b_stacked)
    packed = torch.empty(N, planes, S, R, dtype=act_dtype, device=b0.device)
    for j in range(S):
        write_slot(packed, lora_b_stacked, j)
    return packed


def write_slot(packed: torch.Tensor, lora_b_stacked: tuple[torch.Tensor, ...], index: int) -> None:
    """Bring slot ``index`` of ``packed`` in step with ``lora_b_stacked`` (after set_lora / reset_lora)."""
    planes = packed.shape[1]
    off = 0
    for b in lora_b_stacked:
        n = b.shape[2]
        packed[off : off + n, :, index, :] = _slot_planes(b[index, 0], packed.dtype, planes)
        off += n
