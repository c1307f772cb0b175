"""The LoRA expand of a decode step as its own launch after the GEMM: y[t, cols] += B_i[slot(t)] s_i[t].

``decode_linear``'s epilogue adds the same delta inside the GEMM, after each program's K loop, where
its loads of B are latency that nothing hides (once per wave of the GEMM's programs: gate_up's 8 µs of
LoRA on the H200, session 6). Here one program per block of BLOCK_N columns adds the delta of every
token (``expand_block.block_delta``: all slots in one MMA) in a launch of its own, chained by PDL:

    lora_shrink  ->  decode_linear(after_shrink=True)  ->  lora_expand_dense
    (waits for x)    (starts as the shrink starts;        (starts as the GEMM starts; loads B, then
                      waits for it before exiting)          waits for the GEMM: y and the shrink's buf)

so B streams in while the GEMM runs and what is left after it is one wait, the loads of s and of y
(L2), one MMA and the store. Numbers: the unfused path's (y is the rounded base output; the fp32
delta is added and rounded once), which decode_linear's epilogue also gives, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.expand_block import block_delta, slots_per_chunk
from loraserve.lora.ops.triton.utils import compute_dtype_of, tl_dtype, use_pdl


@triton.jit(do_not_specialize=["M", "S", "SPLIT_K"])
def _lora_expand_dense_kernel(
    y_ptr, buf_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, rank_ptr,
    M, S, SPLIT_K, N0, N1, stride_ym, stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
    R: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, SLOTS_PER_CHUNK: tl.constexpr, RED: tl.constexpr,
    LORA_WDT: tl.constexpr, LORA_CDT: tl.constexpr, LORA_IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    delta = block_delta(
        pid_n, M, buf_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, rank_ptr, S, SPLIT_K, N0, N1,
        stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
        R, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK, RED, LORA_WDT, LORA_CDT, LORA_IEEE, USE_PDL,
    )  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]  # (BLOCK_N, BLOCK_M), as delta
    y_mask = (offs_m < M)[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    # tokens of no slot get delta 0: y + 0 rounds back to the same y
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


BLOCK_N = 64  # columns per program: must divide every slice (decode_linear's block does too)


def supports(y: torch.Tensor, lora_b: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``lora_expand_dense`` takes this layer: <= 32 tokens, slices multiples of BLOCK_N."""
    return 0 < y.shape[0] <= 32 and all(b.shape[2] % BLOCK_N == 0 for b in lora_b)


def lora_expand_dense(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:
    """y (M, sum N_i) += per-slice B_i[slot(t)] buf_i[t] (rounded once), in place; buf from ``lora_shrink``.

    y: bf16/fp16, M <= 32, contiguous rows. lora_b: per slice (S, 1, N_i, R), contiguous, N_i multiples of
    BLOCK_N. token_slots: (M,) int, -1 = base token (left as it is). ranks: (S,) int32. buf: (P, n_slices,
    M, R) fp32 whose P planes sum to each token's s (columns past its slot's rank are never read).
    """
    M, N = y.shape
    n_sl = len(lora_b)
    b0 = lora_b[0]
    split, n_buf, m_buf, R = buf.shape
    assert 1 <= n_sl <= 3 and n_buf == n_sl and m_buf == M, f"buf {tuple(buf.shape)} does not fit y {tuple(y.shape)}"
    assert buf.dtype == torch.float32 and buf.stride(3) == 1
    assert y.stride(1) == 1 and y.dtype in (torch.bfloat16, torch.float16), "y: bf16/fp16, contiguous rows"
    assert supports(y, lora_b), f"{M} tokens, slices {[b.shape[2] for b in lora_b]}: see supports()"
    sizes = [b.shape[2] for b in lora_b]
    assert sum(sizes) == N, f"slices {sizes} do not sum to y's {N} columns"
    for b in lora_b:
        assert b.dtype == b0.dtype and b.shape[0] == b0.shape[0] and b.shape[3] == R
        assert b.stride()[1:] == (b.shape[2] * R, R, 1), "B must be contiguous (out, R) per slot"
    assert token_slots.shape == (M,) and ranks.dtype == torch.int32 and ranks.numel() == b0.shape[0]
    b1 = lora_b[1] if n_sl > 1 else b0
    b2 = lora_b[2] if n_sl > 2 else b0
    block_r = max(16, triton.next_power_of_2(R))
    lcdt = compute_dtype_of(torch.float32 if b0.dtype == torch.float32 else b0.dtype, b0.dtype)
    pdl = use_pdl(y.device)
    _lora_expand_dense_kernel[(N // BLOCK_N,)](
        y, buf, b0, b1, b2, token_slots, ranks,
        M, b0.shape[0], split, sizes[0], sizes[1] if n_sl > 1 else 0, y.stride(0),
        buf.stride(0), buf.stride(1), buf.stride(2), b0.stride(0), b1.stride(0), b2.stride(0),
        R=R, NUM_SLICES=n_sl, BLOCK_M=16 if M <= 16 else 32, BLOCK_N=BLOCK_N, BLOCK_R=block_r,
        SLOTS_PER_CHUNK=slots_per_chunk(b0.shape[0], block_r), RED=min(triton.next_power_of_2(split), 16),
        LORA_WDT=tl_dtype(b0.dtype), LORA_CDT=tl_dtype(lcdt), LORA_IEEE=False,
        USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
