"""LoRA shrink and expand of a prefill batch in ONE launch, the expand overlapping the shrink.

    y[t, off_i + n] += sum_r (x[t] @ A_i[slot(t), r]^T) * B_i[slot(t), n, r],  for 1-3 slices at once

Why: at prefill sizes the two launches of ``lora_shrink`` + ``lora_expand`` run their bytes one after
the other (x's while the shrink runs, y's read and write while the expand runs), and each launch's
head and tail leave the chip half idle. Here one grid holds both kinds of work item, so that y streams
while x does:

- **shrink items** (first): a (block of BLOCK_M tokens of one segment, split of K) computes s for every
  slice (each tile of x loaded once for all of them), stores it to its plane of ``buf`` (fp32), and
  counts its arrival on the block's ``ready`` counter (release, GPU scope).
- **expand items**: a (token block, BLOCK_N columns of one slice) loads its tile of B and of y, THEN
  waits until every split of its token block has arrived (acquire), sums the planes of s in plane order
  (deterministic), multiplies, and stores y rounded once (fp32 add, as ``lora_expand``).

Forward progress: a program's work item is not its program id but a ticket taken from an atomic counter
when it starts, and every shrink item's ticket is lower than every expand item's. A program that waits
therefore waits only for programs that have already started (they took a lower ticket) and never wait
themselves; whatever order the hardware starts programs in, nothing deadlocks. (Under TRITON_INTERPRET
programs run one at a time in ticket order, so no expand item ever waits.)

Counters (``persistent_buffer``, zero between launches): the ticket counter, put back to zero by the
program that takes the last ticket; per token block a ``ready`` and a ``consumed`` counter, both put back
to zero by the block's last expand item (all its splits arrived, all its readers passed their wait).

Opt-in (``ENABLED``, LORASERVE_FUSED_PREFILL=1): on the GPU it was measured slower than the two
launches for every op and dtype tried (see ``ENABLED``), so it stays for experiments and other GPUs.

Numerics: ``lora_shrink`` + ``lora_expand``'s (the products in ``precision.compute_dtype``, s in fp32
summed over planes in order, rounded to the products' dtype before the expand, y rounded once), except
that its shrink products with bf16 x and fp16 A are tf32 where ``lora_shrink``'s prefill ones are fp16
(``FP16_X``): both exact, so only the fp32 summation order can differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.lora_expand import tile_slice
from loraserve.lora.ops.triton.lora_shrink import slices_dot
from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    dot_in,
    interpreted,
    persistent_buffer,
    sum_planes,
    tl_dtype,
)
from loraserve.lora.punica import SegmentMeta


@triton.jit
def _shrink_item(x_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, ready_ptr, tok, m_mask, slot, rank, split, k_per_split, K,
                 stride_xm, stride_as, stride_ar, stride_bsp, stride_bi, stride_bm, R,
                 NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 CDT: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """s of (this token block, split of K) for every slice into plane ``split`` of buf, then one arrival."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    k_begin = split * k_per_split
    x_row = x_ptr + tok[:, None] * stride_xm
    a_off = slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar  # the slices share A's layout
    acc0, acc1, acc2 = slices_dot(x_row, a0_ptr, a1_ptr, a2_ptr, a_off, m_mask, r_mask, k_begin, k_per_split, K,
                                  1, 1, NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, CDT, IEEE)  # fmt: skip
    out = buf_ptr + split * stride_bsp + tok[:, None] * stride_bm + offs_r[None, :]
    out_mask = m_mask[:, None] & (offs_r < R)[None, :]  # zeros past the slot's rank (A masked there)
    tl.store(out, acc0, mask=out_mask)
    if NUM_SLICES > 1:
        tl.store(out + stride_bi, acc1, mask=out_mask)
    if NUM_SLICES > 2:
        tl.store(out + 2 * stride_bi, acc2, mask=out_mask)
    # every thread's stores, then one arrival at GPU scope whose release publishes them
    tl.debug_barrier()
    tl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait_for(ready_ptr, count, SLEEP: tl.constexpr):
    """Spin until *ready_ptr >= count (acquire: the arrivals' stores are visible after it)."""
    seen = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
    while seen < count:
        if SLEEP:  # back off (GPU only: inline PTX) instead of hammering the counter's L2 line
            seen = tl.inline_asm_elementwise("nanosleep.u32 64;\n\tmov.b32 $0, $1;", "=r,r", [seen],
                                             dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
        seen = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")


@triton.jit(do_not_specialize=["T", "S", "MBLOCKS", "SPLIT_K", "tiles0", "tiles01", "TILES"])
def _lora_prefill_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    buf_ptr,  # fp32 (SPLIT_K, NUM_SLICES, T, R): the shrink's planes
    sync_ptr,  # int32: [ticket | ready (S * MBLOCKS) | consumed (S * MBLOCKS)], zero between launches
    meta_ptr,  # int32: order (T,), seg_slot (S,), seg_start (S,), seg_len (S,)
    rank_ptr,  # int32 (max_loras,)
    T,
    S,
    K,
    k_per_split,
    N0,
    N1,
    N2,
    tiles0,
    tiles01,
    TILES,  # column tiles of all slices
    y_offset,
    stride_xm,
    stride_as,
    stride_ar,
    stride_ws0,
    stride_ws1,
    stride_ws2,
    stride_wn,
    stride_bsp,
    stride_bi,
    stride_bm,
    stride_ym,
    R,
    MBLOCKS,  # token blocks of the longest segment
    SPLIT_K,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RED: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
    SLEEP: tl.constexpr,
):
    n_blocks = S * MBLOCKS
    n_shrink = n_blocks * SPLIT_K
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    if ticket == n_shrink + n_blocks * TILES - 1:  # the last ticket: nobody reads the counter again
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
    is_shrink = ticket < n_shrink
    item = tl.where(is_shrink, ticket, ticket - n_shrink)
    per_block = tl.where(is_shrink, SPLIT_K, TILES)
    block = item // per_block  # token block: segment-major
    sub = item % per_block  # its split (shrink) or column tile (expand)
    seg = block // MBLOCKS
    m0 = (block % MBLOCKS) * BLOCK_M

    slot = tl.load(meta_ptr + T + seg)
    seg_start = tl.load(meta_ptr + T + S + seg)
    seg_len = tl.load(meta_ptr + T + 2 * S + seg)
    rank = tl.load(rank_ptr + slot)
    if (rank == 0) | (m0 >= seg_len):
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    ready = sync_ptr + 1 + block
    if is_shrink:
        _shrink_item(x_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, ready, tok, m_mask, slot, rank, sub, k_per_split, K,
                     stride_xm, stride_as, stride_ar, stride_bsp, stride_bi, stride_bm, R,
                     NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, CDT, IEEE)  # fmt: skip
    else:
        w_ptr, stride_ws, sl, n_tile, n_size, col0 = tile_slice(
            sub, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, N2, tiles0, tiles01,
            y_offset, NUM_SLICES,
        )
        offs_r = tl.arange(0, BLOCK_R)
        offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_size
        # B (weights) and y (not the shrink's) before the wait: their bytes stream while s is computed.
        # B's columns past the slot's rank multiply zeros in s (``lora_expand``'s NOTE)
        w = tl.load(
            w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_r[:, None],
            mask=(offs_r < R)[:, None] & n_mask[None, :],
            other=0.0,
        )
        y_ptrs = y_ptr + tok[:, None] * stride_ym + (col0 + offs_n)[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        yv = tl.load(y_ptrs, mask=y_mask, other=0.0)
        _wait_for(ready, SPLIT_K, SLEEP)
        h_ptrs = buf_ptr + sl * stride_bi + tok[:, None] * stride_bm + offs_r[None, :]
        h_mask = m_mask[:, None] & (offs_r < rank)[None, :]
        # past L1 (.cg): other SMs wrote the planes during this launch
        h = sum_planes(h_ptrs, h_mask, SPLIT_K, stride_bsp, RED, True).to(CDT)
        delta = dot_in(h, w, CDT, IEEE)
        tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=y_mask)
        # the block's last reader puts its counters back to zero (every split arrived, every reader waited)
        consumed = sync_ptr + 1 + n_blocks + block
        if tl.atomic_add(consumed, 1, sem="relaxed", scope="gpu") == TILES - 1:
            tl.atomic_xchg(ready, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(consumed, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True)
class FusedPrefillTiles:
    """The one-launch prefill's tiles. A knob: ``bench_lora_kernels.py --tune-fused`` sweeps it at 4096
    tokens (the defaults: its pick on an H100, session 17, over qkv / o / gate_up / down with fp16
    weights). ``programs``: K is split (at most K / (4 * block_k) ways) until the shrink items reach it."""

    block_m: int = 64
    block_k: int = 64
    block_n: int = 256
    programs: int = 256
    num_warps: int = 8
    num_stages: int = 3


FUSED = FusedPrefillTiles()
# the most rank columns per slice the fused kernel keeps in registers (its three accumulators); larger
# ranks take the two-launch path
MAX_RANK = 64
# Opt-in (LORASERVE_FUSED_PREFILL=1): measured on an H100 (session 17, 4096 tokens, 8 adapters) the one
# launch took 1.04-1.38x the time of shrink + expand for qkv, o, gate_up and down in every weight dtype,
# its tiles swept too (BENCHMARKS.md), so ``TritonLoRAOps.add_lora_linear`` takes two launches by default.
ENABLED = os.environ.get("LORASERVE_FUSED_PREFILL", "0") == "1"


def applies(meta: SegmentMeta, R: int, n_slices: int) -> bool:
    """Whether the one-launch path takes this op: prefill-size segments (> 32 tokens), ranks <= MAX_RANK."""
    return ENABLED and meta.max_seg_len > 32 and R <= MAX_RANK and 1 <= n_slices <= 3


def lora_prefill(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    lora_b: tuple[torch.Tensor, ...],
    meta: SegmentMeta,
    ranks: torch.Tensor,
    offset: int = 0,
    tiles: FusedPrefillTiles | None = None,
) -> None:
    """y (T, N) += per-slice B_i(A_i x) per token's slot at columns offset + sum(N_<i), one launch.

    The contracts of ``lora_shrink`` and ``lora_expand`` together: A (S, 1, R, K) and B (S, 1, N_i, R)
    per slice, contiguous; B's columns past a slot's rank finite; tokens of no slot untouched; y fp32
    (an accumulator) or the layer's dtype (rounded once)."""
    tiles = tiles or FUSED
    n = len(lora_a)
    assert 1 <= n <= 3 and len(lora_b) == n, f"1 to 3 slices per launch, got {n}"
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0], "x (T, K) and y (T, N)"
    T, K = x.shape
    a0, b0 = lora_a[0], lora_b[0]
    R = a0.shape[2]
    assert R <= MAX_RANK, f"rank {R} > {MAX_RANK}: take lora_shrink + lora_expand"
    assert a0.dim() == 4 and a0.shape[1] == 1 and a0.shape[3] == K, f"A {tuple(a0.shape)} does not fit x (T, {K})"
    for a, b in zip(lora_a, lora_b):
        assert a.shape == a0.shape and a.stride() == a0.stride() and a.dtype == a0.dtype, "A slices differ"
        assert a.stride(3) == 1 and a.device == x.device, "A must be on x's device, contiguous along K"
        assert b.dtype == b0.dtype and b.shape[0] == a0.shape[0] and b.shape[3] == R, "B slices differ"
        assert b.stride()[1:] == (b.shape[2] * R, R, 1) and b.device == y.device, "B: contiguous (out, R)"
    assert x.stride(1) == 1 and y.stride(1) == 1, "x and y must be contiguous along their last axis"
    sizes = [b.shape[2] for b in lora_b] + [0] * (3 - n)
    assert offset + sum(sizes) <= y.shape[1], f"slices {sizes[:n]} at offset {offset} overflow y {tuple(y.shape)}"
    assert ranks.dtype == torch.int32 and ranks.numel() == a0.shape[0], "ranks: int32, one per slot"
    assert meta.num_tokens == T, f"mapping has {meta.num_tokens} tokens, x has {T}"
    if meta.num_segs == 0 or T == 0:
        return
    block_m, block_k, block_n = tiles.block_m, tiles.block_k, tiles.block_n
    mblocks = triton.cdiv(meta.max_seg_len, block_m)
    n_blocks = mblocks * meta.num_segs
    split, max_split = 1, max(1, K // (4 * block_k))
    while n_blocks * split < tiles.programs and split < max_split:
        split *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    col_tiles = [triton.cdiv(s, block_n) for s in sizes]
    n_tiles = sum(col_tiles)
    buf = torch.empty((split, n, T, R), dtype=torch.float32, device=x.device)
    sync = persistent_buffer(x.device, "lora_prefill/sync", 1 + 2 * n_blocks)
    cdt = compute_dtype_of(x.dtype, a0.dtype)
    assert cdt == compute_dtype_of(x.dtype, b0.dtype), "A and B of one adapter share a dtype"
    a1, a2 = (lora_a[1] if n > 1 else a0), (lora_a[2] if n > 2 else a0)
    b1, b2 = (lora_b[1] if n > 1 else b0), (lora_b[2] if n > 2 else b0)
    grid = (n_blocks * (split + n_tiles),)
    _lora_prefill_kernel[grid](
        x, a0, a1, a2, b0, b1, b2, y, buf, sync, meta.packed, ranks,
        T, meta.num_segs, K, k_per_split, sizes[0], sizes[1], sizes[2],
        col_tiles[0], col_tiles[0] + col_tiles[1], n_tiles, offset,
        x.stride(0), a0.stride(0), a0.stride(2),
        b0.stride(0), b1.stride(0), b2.stride(0), R,
        buf.stride(0), buf.stride(1), buf.stride(2), y.stride(0),
        R, mblocks, split,
        NUM_SLICES=n, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(R)),
        RED=min(triton.next_power_of_2(split), 16), CDT=tl_dtype(cdt), IEEE=cdt == torch.float32 and x.dtype == torch.float32,
        SLEEP=not interpreted(), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
