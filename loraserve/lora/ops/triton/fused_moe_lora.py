"""Expert LoRA on the GPU: shrink and expand over (slot, expert)-aligned blocks.

The assignments of tokens whose slot has LoRA on these experts are aligned by the group
g = slot * E + expert (``moe_align``), so each program owns up to BLOCK_M rows of one
(slot, expert) pair and reads that pair's A (R, K) or B (N, R) once for all of them.

- shrink: buf[i, sl, :r] = x[row(i)] @ A_sl[slot, e, :r]^T (fp32), one launch for all slices;
- expand: y[i, cols_sl] = round(y[i, cols_sl] + buf[i, sl] @ B_sl[slot, e]^T) (fp32 sum, one
  rounding, as the torch path), one launch for all slices. ``cols_sl`` = col_offset[sl] +
  j * col_stride: contiguous [gate; up] halves, or the interleaved columns of a GPT-OSS w13.

Work follows each slot's own rank: columns r >= rank[slot] are masked, so their bytes are never
read. Products run in ``utils.compute_dtype_of``'s dtype with fp32 accumulation (the weights', or tf32
for fp32 weights, and for fp16 weights with bf16 activations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.layers.moe_align import AlignedBlocks
from loraserve.lora.ops.triton.utils import compute_dtype_of, dot_in, tl_dtype


# NOTE: sizes (K, N, column offsets) are specialized, not do_not_specialize: Triton then knows they are
# multiples of 16 and vectorizes the masked loads along the contiguous axis; as runtime ints every
# masked load there went scalar. Specializing compiles once per divisibility class, not per value.
@triton.jit(do_not_specialize=["n_valid", "E"])
def _moe_lora_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    buf_ptr,
    sorted_ptr,
    block_group_ptr,
    rank_ptr,
    n_valid,
    E,
    K,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_bm,
    stride_bsl,
    TOKEN_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    sl = tl.program_id(1)
    g = tl.load(block_group_ptr + pid_m)
    if g < 0:
        return
    slot = g // E
    e = g % E
    rank = tl.load(rank_ptr + slot)
    if sl == 0:
        a_ptr = a0_ptr
    else:
        a_ptr = a1_ptr
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m).to(tl.int64)
    m_mask = rows < n_valid
    x_base = x_ptr + (rows // TOKEN_DIV)[:, None] * stride_xm
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as + e.to(tl.int64) * stride_ae + offs_r[None, :] * stride_ar
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        xt = tl.load(x_base + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + kk[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += dot_in(xt, at, CDT, IEEE)
    out = buf_ptr + rows[:, None] * stride_bm + sl * stride_bsl + offs_r[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & (offs_r < BLOCK_R)[None, :])


@triton.jit(do_not_specialize=["n_valid", "E"])
def _moe_lora_expand_kernel(
    buf_ptr,
    b0_ptr,
    b1_ptr,
    y_ptr,
    sorted_ptr,
    block_group_ptr,
    rank_ptr,
    n_valid,
    E,
    N,
    col_off0,
    col_off1,
    col_stride,
    R,
    stride_bm,
    stride_bsl,
    stride_ws,
    stride_we,
    stride_wn,
    stride_wr,
    stride_ym,
    stride_yn,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid = tl.program_id(1)
    sl = pid % NUM_SLICES
    pid_n = pid // NUM_SLICES
    g = tl.load(block_group_ptr + pid_m)
    if g < 0:
        return
    slot = g // E
    e = g % E
    rank = tl.load(rank_ptr + slot)
    if sl == 0:
        b_ptr = b0_ptr
        col_off = col_off0
    else:
        b_ptr = b1_ptr
        col_off = col_off1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m).to(tl.int64)
    m_mask = rows < n_valid
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    xa = tl.load(
        buf_ptr + rows[:, None] * stride_bm + sl * stride_bsl + offs_r[None, :],
        mask=m_mask[:, None] & r_mask[None, :],
        other=0.0,
    )
    bt = tl.load(
        b_ptr + slot.to(tl.int64) * stride_ws + e.to(tl.int64) * stride_we
        + offs_n[None, :] * stride_wn + offs_r[:, None] * stride_wr,
        mask=(offs_r < R)[:, None] & n_mask[None, :],  # NOTE: not by rank: as in lora_expand.py
        other=0.0,
    )  # fmt: skip
    delta = dot_in(xa, bt, CDT, IEEE)
    cols = col_off + offs_n * col_stride
    y = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    cur = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, (cur + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def moe_lora_shrink(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    blocks: AlignedBlocks,
    ranks: torch.Tensor,
    token_div: int,
) -> torch.Tensor:
    """x (M, K), lora_a[sl] (S, E, R, K) -> buf (n, n_slices, BLOCK_R) fp32; row i holds x[i // token_div]
    through A_sl of its block's (slot, expert). Rows outside every block are left unwritten."""
    n_slices = len(lora_a)
    assert 1 <= n_slices <= 2, f"1 or 2 slices per launch, got {n_slices}"
    a0 = lora_a[0]
    assert a0.dim() == 4 and a0.shape[3] == x.shape[1], f"A {tuple(a0.shape)} does not fit x {tuple(x.shape)}"
    for a in lora_a:
        assert a.shape == a0.shape and a.stride() == a0.stride() and a.dtype == a0.dtype, "slices differ in layout"
    S, E, R, K = a0.shape
    assert ranks.dtype == torch.int32 and ranks.numel() == S, "ranks: int32, one per slot"
    block_r = _block_r(R)
    n = blocks.num_valid
    buf = torch.empty(n, n_slices, block_r, dtype=torch.float32, device=x.device)
    if n == 0:
        return buf
    cdt = compute_dtype_of(x.dtype, a0.dtype)
    grid = (blocks.num_blocks, n_slices)
    _moe_lora_shrink_kernel[grid](
        x, a0, lora_a[-1], buf, blocks.sorted_ids, blocks.block_group, ranks, n, E, K,
        x.stride(0), x.stride(1), a0.stride(0), a0.stride(1), a0.stride(2), a0.stride(3),
        buf.stride(0), buf.stride(1),
        TOKEN_DIV=token_div, BLOCK_M=blocks.block_m, BLOCK_K=64, BLOCK_R=block_r,
        CDT=tl_dtype(cdt), IEEE=cdt == torch.float32 and x.dtype == torch.float32,
        num_warps=4,
    )  # fmt: skip
    return buf


def moe_lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    blocks: AlignedBlocks,
    ranks: torch.Tensor,
    col_offsets: tuple[int, ...],
    col_stride: int,
    act_dtype: torch.dtype,
) -> None:
    """y (n, *) += per slice buf[:, sl] @ B_sl[slot, e]^T at columns col_offsets[sl] + j * col_stride
    (j < N, lora_b[sl] (S, E, N, R)), for the rows of the blocks; fp32 sum, one rounding."""
    n_slices = len(lora_b)
    assert n_slices == len(col_offsets) and n_slices == buf.shape[1], "one column offset and buf plane per slice"
    b0 = lora_b[0]
    for b in lora_b:
        assert b.shape == b0.shape and b.stride() == b0.stride() and b.dtype == b0.dtype, "slices differ in layout"
    S, E, N, R = b0.shape
    n = blocks.num_valid
    if n == 0:
        return
    block_n = 64
    cdt = compute_dtype_of(act_dtype, b0.dtype)
    grid = (blocks.num_blocks, n_slices * triton.cdiv(N, block_n))
    _moe_lora_expand_kernel[grid](
        buf, b0, lora_b[-1], y, blocks.sorted_ids, blocks.block_group, ranks, n, E, N,
        col_offsets[0], col_offsets[-1], col_stride, R,
        buf.stride(0), buf.stride(1), b0.stride(0), b0.stride(1), b0.stride(2), b0.stride(3),
        y.stride(0), y.stride(1),
        NUM_SLICES=n_slices, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_R=buf.shape[2],
        CDT=tl_dtype(cdt), IEEE=act_dtype == torch.float32 and cdt == torch.float32,
        num_warps=4,
    )  # fmt: skip
