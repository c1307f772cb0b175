"""LoRA shrink on the GPU: buf[0, i, t, :r] = x[t] @ A_i[slot(t), :r]^T, in fp32.

One launch for all 1-3 slices of a layer. Tokens arrive sorted by slot (``SegmentMeta``); a program
owns (split of K, rank block, slice) x (block of tokens of one segment). The grid's rank axis covers
the batch's largest rank, and a program whose rank block starts at or past its slot's own rank
returns at once, so work and bytes follow each adapter's rank, not max_lora_rank.

``expand=True`` (decode_linear's LoRA columns, ``lora/layers/packed_b.py``): the output is instead s
(n_slices, T, S*R) in x's dtype, each token's row laid out over every slot's columns, its own slot's
holding its h (rounded to x's dtype) and every other column zero. The rank axis then covers all R
columns, and programs past their slot's rank store zeros: every column of a token with a slot is
written. Rows of tokens without a slot are not (decode_linear masks them by slot).

Split-K (decode sizes have few segments, so K is split to keep the SMs streaming A): every split
writes its partial to its own plane of ``buf``; the last program of a group to arrive (an atomic
counter) sums the planes in plane order, up to 16 independent loads at a time, and writes the total
to plane 0 (``reduce=True``, the engine's default); or (LORASERVE_SHRINK_REDUCE=0) each split keeps
its plane and the reader (the expand, or decode_linear's epilogue) sums them the same way while
loading. Either is deterministic and needs no zeroing. Summing here measured cheaper at decode
(H200, Llama-8B, 32 tokens, 8 adapters: 31.0 vs 33.5 µs of LoRA cost per layer, BENCHMARKS.md
session 6): decode_linear's epilogue runs once per wave of its programs, after the K loop, where
the plane loads are latency nobody hides; here they are one program's tail per group.

At decode sizes each program's K range is a single block: its tile of A (weights, written before
the forward) is loaded before the PDL wait, overlapping the previous kernel's tail; x is read after.
With ``expand`` the shrink lets its dependent (decode_linear, which waits for it before reading
anything) launch at once, so that the GEMM can start pulling W into L2 while the shrink runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    dot_in,
    persistent_buffer,
    sum_planes,
    tl_dtype,
    use_pdl,
)
from loraserve.lora.punica import SegmentMeta


@triton.jit
def _store_expanded(s_ptr, sl, tok, m_mask, slot, r0, vals, R, NSLOT, stride_ss, stride_st,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS_PER_STORE: tl.constexpr):  # fmt: skip
    """Rank columns r0 .. r0 + BLOCK_R (< R) of every slot's part of these tokens' rows of s: ``vals``
    (BLOCK_M, BLOCK_R) in the tokens' own slot, zeros in every other, rounded to s's dtype."""
    offs_c = tl.arange(0, SLOTS_PER_STORE * BLOCK_R)
    c_r = r0 + offs_c % BLOCK_R
    v = tl.reshape(
        tl.broadcast_to(vals[:, None, :], (BLOCK_M, SLOTS_PER_STORE, BLOCK_R)), (BLOCK_M, SLOTS_PER_STORE * BLOCK_R)
    )
    row = s_ptr + sl * stride_ss + tok[:, None] * stride_st
    for j0 in range(0, NSLOT, SLOTS_PER_STORE):
        c_j = j0 + offs_c // BLOCK_R
        out = tl.where(c_j[None, :] == slot, v, 0.0).to(s_ptr.dtype.element_ty)
        tl.store(row + (c_j * R + c_r)[None, :], out, mask=m_mask[:, None] & ((c_j < NSLOT) & (c_r < R))[None, :])


# NOTE: sizes (K, N, column offsets) are specialized, not do_not_specialize: Triton then knows they are
# multiples of 16 and vectorizes the masked loads along the contiguous axis; as runtime ints every
# masked load there went scalar. Specializing compiles once per divisibility class, not per value.
@triton.jit(do_not_specialize=["T", "S", "R", "NUM_RBLOCKS", "SPLIT_K", "NSLOT"])
def _lora_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    buf_ptr,
    s_ptr,  # (EXPAND) (n_slices, T, NSLOT * R) in x's dtype
    cnt_ptr,  # int32 (groups,): split arrivals per group, zero between launches (SPLIT_K > 1)
    meta_ptr,  # int32: order (T,), seg_slot (S,), seg_start (S,), seg_len (S,)
    rank_ptr,  # int32 (max_loras,): this layer's rank per slot
    T,
    S,
    K,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_bsp,
    stride_bi,
    stride_bm,
    R,  # buf's (and A's) rank columns
    NSLOT,  # (EXPAND) slots (A's first dimension)
    stride_ss,
    stride_st,
    NUM_SLICES: tl.constexpr,
    NUM_RBLOCKS,
    SPLIT_K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RED: tl.constexpr,  # planes a group's last split loads at once (1: no reduction here, see REDUCE)
    REDUCE: tl.constexpr,  # sum the splits here (the last arrival); else each split keeps its plane
    ONE_CHUNK: tl.constexpr,  # k_per_split == BLOCK_K: one tile of A per program, loaded before the wait
    EXPAND: tl.constexpr,  # write s (every slot's columns; zeros past the rank and in other slots), not buf
    SLOTS_PER_STORE: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid0 = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2)
    split = pid0 % SPLIT_K
    rblock = (pid0 // SPLIT_K) % NUM_RBLOCKS
    sl = pid0 // (SPLIT_K * NUM_RBLOCKS)

    slot = tl.load(meta_ptr + T + seg)
    seg_start = tl.load(meta_ptr + T + S + seg)
    seg_len = tl.load(meta_ptr + T + 2 * S + seg)
    rank = tl.load(rank_ptr + slot)
    r0 = rblock * BLOCK_R
    m0 = pid_m * BLOCK_M
    if USE_PDL and EXPAND:
        # decode_linear waits for this whole launch before reading anything: it may launch at once
        tl.extra.cuda.gdc_launch_dependents()
    if (r0 >= rank) | (m0 >= seg_len):
        if USE_PDL:
            # NOTE: a program that exits counts as having triggered its PDL dependents, and a dependent
            # may trust that every shrink program waited for x first: so wait here too (a batch of base
            # tokens only, under a CUDA graph, exits every program); and no store before the wait
            tl.extra.cuda.gdc_wait()
        if EXPAND:
            # columns past the slot's rank (a rank-0 slot: all of them) hold zeros: decode_linear reads
            # every column of the rows of tokens with a slot (one split stores them)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = (offs_m < seg_len) & (split == 0)
            tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
            _store_expanded(s_ptr, sl, tok, m_mask, slot, r0, tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32), R,
                            NSLOT, stride_ss, stride_st, BLOCK_M, BLOCK_R, SLOTS_PER_STORE)  # fmt: skip
        return

    if NUM_SLICES == 1:
        a_ptr = a0_ptr
    else:
        if sl == 0:
            a_ptr = a0_ptr
        elif sl == 1:
            a_ptr = a1_ptr
        else:
            a_ptr = a2_ptr

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # (BLOCK_M,)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    x_row = x_ptr + tok[:, None] * stride_xm
    a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    if ONE_CHUNK:
        kk = k_begin + offs_k
        k_mask = kk < K
        at = tl.load(a_base + kk[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if USE_PDL:  # launched early (PDL): x and buf only after the kernel before has finished and flushed
            tl.extra.cuda.gdc_wait()
            if not EXPAND:
                tl.extra.cuda.gdc_launch_dependents()  # the expand may launch now; it waits for us before reading buf
        xt = tl.load(x_row + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot_in(xt, at, CDT, IEEE)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            if not EXPAND:
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, k_per_split, BLOCK_K):
            kk = k_begin + k + offs_k
            k_mask = kk < K
            xt = tl.load(x_row + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_base + kk[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc += dot_in(xt, at, CDT, IEEE)
    out = buf_ptr + sl * stride_bi + tok[:, None] * stride_bm + offs_r[None, :]  # plane 0
    out_mask = m_mask[:, None] & (offs_r < R)[None, :]  # zeros past the rank (A masked there)
    if EXPAND and not REDUCE:
        _store_expanded(s_ptr, sl, tok, m_mask, slot, r0, acc, R, NSLOT, stride_ss, stride_st, BLOCK_M, BLOCK_R,
                        SLOTS_PER_STORE)  # fmt: skip
        return
    tl.store(out + split * stride_bsp, acc, mask=out_mask)
    if REDUCE:
        # NOTE: the semaphore pattern of decode_linear's split-K: all threads' stores, a CTA barrier, one
        # acq_rel atomic at GPU scope; the last arrival reads the planes past L1 (.cg, not coherent across
        # SMs), in plane order whoever it is, and puts the counter back to zero for the next launch
        tl.debug_barrier()
        group = ((sl * NUM_RBLOCKS + rblock) * tl.num_programs(1) + pid_m) * S + seg
        arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = sum_planes(out, out_mask, SPLIT_K, stride_bsp, RED, True)
            if EXPAND:
                _store_expanded(s_ptr, sl, tok, m_mask, slot, r0, total, R, NSLOT, stride_ss, stride_st, BLOCK_M,
                                BLOCK_R, SLOTS_PER_STORE)  # fmt: skip
            else:
                tl.store(out, total, mask=out_mask)
            tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")


# Tuning knobs (module attributes, so that benchmarks/gpu/bench_decode_linear.py --matrix can sweep them):
DECODE_BLOCK_K = (256, 512)  # the decode K block for K <= 8192 and beyond
PREFETCH_A = True  # at decode sizes, load the tile of A before the PDL wait


def _pick_blocks(meta: SegmentMeta, n_slices: int, n_rblocks: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, SPLIT_K): enough programs to fill the chip at decode sizes.

    Decode sizes (segments of <= 32 tokens): one K block of 256 (512 past K = 8192) per program
    (ONE_CHUNK): 128-450 programs for Llama-8B's layers with 8 adapters. Larger segments: 64 K a
    step, K split until ~512 programs (at most 4 steps a split is left alone).
    """
    longest = meta.max_seg_len
    block_m = 16 if longest <= 16 else (32 if longest <= 32 else 64)
    groups = n_slices * n_rblocks * triton.cdiv(longest, block_m) * meta.num_segs
    if block_m <= 32:
        # NOTE: from K alone, not from how many adapters the batch has: eager steps and CUDA graphs
        # (whose static meta has a segment per slot) then split alike and sum the same partials
        block_k = DECODE_BLOCK_K[0] if K <= 8192 else DECODE_BLOCK_K[1]
        return block_m, block_k, triton.cdiv(K, block_k)
    block_k = 64
    split = 1
    max_split = max(1, K // (4 * block_k))
    while groups * split < 512 and split < max_split:
        split *= 2
    return block_m, block_k, split


def _new_buf(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The output's storage, uninitialized (a seam: tests fill it with NaN to see what is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def lora_shrink(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    meta: SegmentMeta,
    ranks: torch.Tensor,
    max_rank: int,
    block_r: int = 16,
    reduce: bool = True,
    expand: bool = False,
) -> torch.Tensor:
    """x (T, K) with lora_a[i] (S, 1, R, K) -> buf (P, n_slices, T, R) fp32 whose planes sum to x @ A_i[slot]^T.

    ``reduce``: the kernel sums its split-K partials itself, P = 1 (the engine's default); else P = the
    split and the reader (``lora_expand``) sums the planes while loading them. ``max_rank``: the largest
    of ``ranks`` in use (at most R). Rows of tokens with a slot are written at columns r < ranks[slot],
    which is all ``lora_expand`` reads; rows of tokens without a slot are never written.

    ``expand``: returns s (n_slices, T, S*R) in x's dtype instead (decode_linear's LoRA columns; the
    module docstring), the splits always summed here.
    """
    n = len(lora_a)
    assert 1 <= n <= 3, f"1 to 3 slices per launch, got {n}"
    assert x.dim() == 2, f"x must be 2-D (T, K), got {tuple(x.shape)}"
    T, K = x.shape
    a0 = lora_a[0]
    assert a0.dim() == 4 and a0.shape[1] == 1 and a0.shape[3] == K, (
        f"A {tuple(a0.shape)} does not fit x (T, {K})"
    )
    for a in lora_a:
        assert a.shape == a0.shape and a.stride() == a0.stride() and a.dtype == a0.dtype, (
            "slices differ in layout"
        )
        assert a.device == x.device and a.stride(3) == 1, "A must be on x's device, contiguous along K"
    assert ranks.dtype == torch.int32 and ranks.numel() == a0.shape[0] and ranks.device == x.device, (
        "ranks: int32, one per slot"
    )
    assert meta.packed.device == x.device and meta.packed.dtype == torch.int32
    assert meta.num_tokens == T, f"mapping has {meta.num_tokens} tokens, x has {T}"
    R = a0.shape[2]
    assert max_rank <= R
    S = a0.shape[0]
    # expand: the rank axis covers all R columns, not max_rank (programs past a slot's rank store zeros)
    n_rblocks = triton.cdiv(R if expand else max(max_rank, 1), block_r)
    block_m, block_k, split = _pick_blocks(meta, n, n_rblocks, K)
    buf = _new_buf((split, n, T, R), x.device)
    s_out = _new_buf((n, T, S * R), x.device, x.dtype) if expand else buf
    if meta.num_segs == 0 or T == 0:
        return s_out if expand else buf[:1]  # nothing is read
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    cdt = compute_dtype_of(x.dtype, a0.dtype)
    a1 = lora_a[1] if n > 1 else a0
    a2 = lora_a[2] if n > 2 else a0
    grid = (split * n_rblocks * n, triton.cdiv(meta.max_seg_len, block_m), meta.num_segs)
    reduce = (reduce or expand) and split > 1
    cnt = buf
    if reduce:
        cnt = persistent_buffer(x.device, "lora_shrink/arrivals", n * n_rblocks * grid[1] * grid[2])
    pdl = use_pdl(x.device)
    _lora_shrink_kernel[grid](
        x, a0, a1, a2, buf, s_out, cnt, meta.packed, ranks,
        T, meta.num_segs, K, k_per_split,
        x.stride(0), x.stride(1),
        a0.stride(0), a0.stride(2), a0.stride(3),
        buf.stride(0), buf.stride(1), buf.stride(2), R, S, s_out.stride(0), s_out.stride(1),
        NUM_SLICES=n, NUM_RBLOCKS=n_rblocks, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, RED=min(triton.next_power_of_2(split), 16), REDUCE=reduce, ONE_CHUNK=PREFETCH_A and k_per_split == block_k,
        EXPAND=expand, SLOTS_PER_STORE=max(1, min(triton.next_power_of_2(S), 128 // block_r)),
        CDT=tl_dtype(cdt), IEEE=cdt == torch.float32 and x.dtype == torch.float32,
        USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    if expand:
        return s_out
    return buf[:1] if reduce else buf
