"""LoRA shrink on the GPU: buf[0, i, t, :r] = x[t] @ A_i[slot(t), :r]^T, in fp32.

One launch for all 1-3 slices of a layer. Tokens arrive sorted by slot (``SegmentMeta``); a program
owns (split of K, rank block, slice) x (block of tokens of one segment). The grid's rank axis covers
the batch's largest rank, and a program whose rank block starts at or past its slot's own rank
returns at once, so work and bytes follow each adapter's rank, not max_lora_rank. With ``zero_fill``
(decode_linear's epilogue, which loads no rank) the axis covers all R columns and those programs store
zeros instead: every column of a token with a slot is written.

Split-K (decode sizes have few segments, so K is split to keep the SMs streaming A): every split
writes its partial to its own plane of ``buf``; the last program of a group to arrive (an atomic
counter) sums the planes in plane order, up to 16 independent loads at a time, and writes the total
to plane 0: deterministic, and no zeroing. Summing here measured cheaper at decode than leaving the
planes to the reader (H200, Llama-8B, 32 tokens, 8 adapters: 31.0 vs 33.5 µs of LoRA cost per layer):
decode_linear's epilogue runs once per wave of its programs, after the K loop, where the plane loads
are latency nobody hides; here they are one program's tail per group.

At decode sizes each program's K range is a single block. A program of one slice (fp32 A) loads its
tile of A (weights, written before the forward) before the PDL wait, overlapping the previous kernel's
tail, and x after it. A program of half-precision A (bf16, or fp16: auto's GPU storage for bf16
models) computes every slice of its tile (``_fuse_decode``) and loads A after the wait (measured
faster that way: with fp16 A 16.2 against 17.6 µs a layer; with fp32 A the other way, 24.9 against
27.9, the tile of fp32 A it loads after the wait being twice the bytes). Prefill (segments longer
than 32 tokens) takes ``PREFILL``'s tiles, where a program owns every slice of its tile and loads each
tile of x once for all of them.

NOTE: at prefill (the prefill tiles), bf16 x with fp16 A (auto's GPU storage) casts x to fp16 and
multiplies in fp16 (``x_dot``; decode keeps tf32, where fp16 measured slower: 22.1 against 15.7 µs of
LoRA a layer): fp16 holds every bf16 value in [2^-17, 65504] exactly (8 significant bits in 11), so the
products are exact as with tf32, without x's fp32 copy in shared memory (qkv's shrink at 4096 tokens
17.0 against 24.1 µs). x below 2^-17 rounds to fp16's subnormal grid (absolute error <= 2^-25 per
entry). An x past 65504 becomes inf, and its block's sums inf or NaN (products of finite fp16 cannot
overflow fp32); a block whose sums are not finite (``overflowed``: one reduction after the K loop) is
computed again in tf32, and those are its sums, so outliers cost time, never accuracy. Splitting A into
two bf16 halves instead (hi + lo, two bf16 MMAs) was slower and spilled at decode; it was removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    dot_in,
    persistent_buffer,
    slice_ptr,
    sum_planes,
    tl_dtype,
    use_pdl,
)
from loraserve.lora.punica import SegmentMeta


@triton.jit
def _out_mask(m_mask, offs_r, R, EVEN_R: tl.constexpr):
    """The mask of a (BLOCK_M, BLOCK_R) tile of buf: the block's tokens, and columns r < R unless EVEN_R (R a
    multiple of BLOCK_R, so every column of the grid is < R): a mask constant along r lets the compiler store
    and load 16 bytes a thread instead of 4 (R is a runtime value; Nsight Compute showed the prefill shrink's
    partial stores and plane loads using a quarter of each sector)."""
    if EVEN_R:
        r_ok = tl.full(offs_r.shape, 1, tl.int1)  # a splat: the compiler sees the mask constant along r
    else:
        r_ok = offs_r < R
    return m_mask[:, None] & r_ok[None, :]


@triton.jit
def _store_zeros(buf_ptr, meta_ptr, seg_start, seg_len, m0, r0, split, sl, R, stride_bsp, stride_bi, stride_bm,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, REDUCE: tl.constexpr, EVEN_R: tl.constexpr):  # fmt: skip
    """Zeros into columns r0 .. r0 + BLOCK_R (< R) of this block's tokens, in this split's plane (with
    REDUCE only split 0 stores: plane 0 is all that is read)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    if REDUCE:
        m_mask = m_mask & (split == 0)
    tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    ptrs = buf_ptr + split * stride_bsp + sl * stride_bi + tok[:, None] * stride_bm + offs_r[None, :]
    tl.store(ptrs, tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32), mask=_out_mask(m_mask, offs_r, R, EVEN_R))


@triton.jit
def x_dot(xt, at, CDT: tl.constexpr, IEEE: tl.constexpr, X16: tl.constexpr):
    """xt @ at in fp32: with X16 (bf16 x, fp16 A) x is cast to fp16 and the tensor cores multiply fp16 (exact
    for |x| in [2^-17, 65504]; an x past 65504 becomes inf, which ``overflowed`` sees); else ``dot_in``."""
    if X16:
        out = tl.dot(xt.to(tl.float16), at)
    else:
        out = dot_in(xt, at, CDT, IEEE)
    return out


@triton.jit
def overflowed(acc):
    """Whether a tile of fp32 sums holds inf or NaN: what an x past fp16's range leaves behind in an X16
    product (fp16 products of finite values cannot overflow fp32: 65504^2 < 2^32)."""
    ok = tl.abs(acc) <= 3.4028234663852886e38  # false for inf and NaN
    return tl.min(tl.min(ok.to(tl.int32), axis=1), axis=0) == 0


@triton.jit
def _slices_loop(x_row, a0_ptr, a1_ptr, a2_ptr, a_off, m_mask, r_mask, k_begin, k_per_split, K, stride_xk, stride_ak,
                 NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 CDT: tl.constexpr, IEEE: tl.constexpr, X16: tl.constexpr):  # fmt: skip
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        kk = k_begin + k + offs_k
        k_mask = kk < K
        xt = tl.load(x_row + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_mask = k_mask[:, None] & r_mask[None, :]
        a_k = a_off + kk[:, None] * stride_ak
        acc0 += x_dot(xt, tl.load(a0_ptr + a_k, mask=a_mask, other=0.0), CDT, IEEE, X16)
        if NUM_SLICES > 1:
            acc1 += x_dot(xt, tl.load(a1_ptr + a_k, mask=a_mask, other=0.0), CDT, IEEE, X16)
        if NUM_SLICES > 2:
            acc2 += x_dot(xt, tl.load(a2_ptr + a_k, mask=a_mask, other=0.0), CDT, IEEE, X16)
    return acc0, acc1, acc2


@triton.jit
def slices_dot(x_row, a0_ptr, a1_ptr, a2_ptr, a_off, m_mask, r_mask, k_begin, k_per_split, K, stride_xk, stride_ak,
               NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
               CDT: tl.constexpr, IEEE: tl.constexpr, X16: tl.constexpr = False):  # fmt: skip
    """(x A_i^T) of a token block (rows ``x_row``) over K in [k_begin, k_begin + k_per_split) for every
    slice, fp32 (slices past NUM_SLICES zeros): each tile of x loaded once for all of them. A's columns
    past ``r_mask`` read as zeros. X16: fp16 products (``x_dot``); a block whose sums came out non-finite
    (an x past fp16's range) is computed again in CDT (tf32), which is the result."""
    acc0, acc1, acc2 = _slices_loop(x_row, a0_ptr, a1_ptr, a2_ptr, a_off, m_mask, r_mask, k_begin, k_per_split, K,
                                    stride_xk, stride_ak, NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, CDT, IEEE, X16)  # fmt: skip
    if X16:
        if overflowed(acc0 + acc1 + acc2):
            acc0, acc1, acc2 = _slices_loop(x_row, a0_ptr, a1_ptr, a2_ptr, a_off, m_mask, r_mask, k_begin,
                                            k_per_split, K, stride_xk, stride_ak, NUM_SLICES, BLOCK_M, BLOCK_K,
                                            BLOCK_R, CDT, IEEE, False)  # fmt: skip
    return acc0, acc1, acc2


@triton.jit
def _shrink_all_slices(x_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, cnt_ptr, meta_ptr, S, K, k_per_split,
                       stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_bsp, stride_bi, stride_bm,
                       R, NUM_SLICES: tl.constexpr, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_R: tl.constexpr, RED: tl.constexpr, REDUCE: tl.constexpr, CDT: tl.constexpr,
                       IEEE: tl.constexpr, X16: tl.constexpr, USE_PDL: tl.constexpr, EVEN_R: tl.constexpr, slot,
                       seg, seg_start, seg_len, rank, rblock, split, pid_m):  # fmt: skip
    """FUSE_SLICES (prefill, and decode with half-precision A): one program computes the tile (BLOCK_M tokens, BLOCK_R ranks, its K split) of
    every slice, each tile of x loaded once for all of them; then the same stores and split sum as a
    one-slice program, with one arrival for the slices together."""
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    k_begin = split * k_per_split
    x_row = x_ptr + tok[:, None] * stride_xm
    a_off = slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar  # the slices share A's layout
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc0, acc1, acc2 = slices_dot(x_row, a0_ptr, a1_ptr, a2_ptr, a_off, m_mask, r_mask, k_begin, k_per_split, K,
                                  stride_xk, stride_ak, NUM_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, CDT, IEEE, X16)  # fmt: skip
    out = buf_ptr + tok[:, None] * stride_bm + offs_r[None, :]  # slice 0, plane 0
    out_mask = _out_mask(m_mask, offs_r, R, EVEN_R)
    tl.store(out + split * stride_bsp, acc0, mask=out_mask)
    if NUM_SLICES > 1:
        tl.store(out + stride_bi + split * stride_bsp, acc1, mask=out_mask)
    if NUM_SLICES > 2:
        tl.store(out + 2 * stride_bi + split * stride_bsp, acc2, mask=out_mask)
    if REDUCE:  # as the one-slice program's (see there), a group being (rank block, token block, segment)
        tl.debug_barrier()
        group = (rblock * tl.num_programs(1) + pid_m) * S + seg
        arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for i in tl.static_range(NUM_SLICES):
                o = out + i * stride_bi
                tl.store(o, sum_planes(o, out_mask, SPLIT_K, stride_bsp, RED, True), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")


@triton.jit
def _shrink_one_slice(x_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, cnt_ptr, meta_ptr, S, K, k_per_split, stride_xm,
                      stride_xk, stride_as, stride_ar, stride_ak, stride_bsp, stride_bi, stride_bm, R,
                      NUM_SLICES: tl.constexpr, NUM_RBLOCKS, SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_R: tl.constexpr, RED: tl.constexpr, REDUCE: tl.constexpr, ONE_CHUNK: tl.constexpr,
                      CDT: tl.constexpr, IEEE: tl.constexpr, X16: tl.constexpr, USE_PDL: tl.constexpr,
                      EVEN_R: tl.constexpr, slot, seg, seg_start, seg_len, rank, rblock, split, sl, pid_m):  # fmt: skip
    """A program that owns one slice of its tile (decode with fp32 A, and prefill of one-slice layers)."""
    r0 = rblock * BLOCK_R
    m0 = pid_m * BLOCK_M
    if NUM_SLICES == 1:
        a_ptr = a0_ptr
    else:
        a_ptr = slice_ptr(sl, a0_ptr, a1_ptr, a2_ptr)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # (BLOCK_M,)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    x_row = x_ptr + tok[:, None] * stride_xm
    a_off = slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    a_base = a_ptr + a_off
    if ONE_CHUNK:
        kk = k_begin + offs_k
        k_mask = kk < K
        at = tl.load(a_base + kk[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if USE_PDL:  # launched early (PDL): x and buf only after the kernel before has finished and flushed
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the expand may launch now; it waits for us before reading buf
        xt = tl.load(x_row + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = x_dot(xt, at, CDT, IEEE, X16)
        if X16:
            if overflowed(acc):  # an x past fp16's range: this tile in tf32 (see slices_dot)
                acc = dot_in(xt, at, CDT, IEEE)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        acc, _, _ = slices_dot(x_row, a_ptr, a_ptr, a_ptr, a_off, m_mask, r_mask, k_begin, k_per_split, K, stride_xk,
                               stride_ak, 1, BLOCK_M, BLOCK_K, BLOCK_R, CDT, IEEE, X16)  # fmt: skip
    out = buf_ptr + sl * stride_bi + tok[:, None] * stride_bm + offs_r[None, :]  # plane 0
    out_mask = _out_mask(m_mask, offs_r, R, EVEN_R)  # zeros past the rank (A masked there)
    tl.store(out + split * stride_bsp, acc, mask=out_mask)
    if REDUCE:
        # NOTE: the semaphore pattern of decode_linear's split-K: all threads' stores, a CTA barrier, one
        # acq_rel atomic at GPU scope; the last arrival reads the planes past L1 (.cg, not coherent across
        # SMs), in plane order whoever it is, and puts the counter back to zero for the next launch
        tl.debug_barrier()
        group = ((sl * NUM_RBLOCKS + rblock) * tl.num_programs(1) + pid_m) * S + seg
        arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.store(out, sum_planes(out, out_mask, SPLIT_K, stride_bsp, RED, True), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")


# NOTE: sizes (K, N, column offsets) are specialized, not do_not_specialize: Triton then knows they are
# multiples of 16 and vectorizes the masked loads along the contiguous axis; as runtime ints every
# masked load there went scalar. Specializing compiles once per divisibility class, not per value.
@triton.jit(do_not_specialize=["T", "S", "R", "NUM_RBLOCKS", "SPLIT_K"])
def _lora_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    buf_ptr,
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
    R,  # buf's (and A's) rank columns: all of them are written for the tokens of every segment
    NUM_SLICES: tl.constexpr,
    NUM_RBLOCKS,
    SPLIT_K,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RED: tl.constexpr,  # planes a group's last split loads at once (1: no reduction here, see REDUCE)
    REDUCE: tl.constexpr,  # SPLIT_K > 1: the last arrival sums the splits into plane 0
    ONE_CHUNK: tl.constexpr,  # k_per_split == BLOCK_K: one tile of A per program, loaded before the wait
    ZERO_FILL: tl.constexpr,  # programs past their slot's rank store zeros (the columns the readers see)
    FUSE_SLICES: tl.constexpr,  # a program computes every slice of its tile (x read once), not one
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
    X16: tl.constexpr,  # bf16 x, fp16 A: fp16 products, a block with an x past fp16's range again in CDT
    USE_PDL: tl.constexpr,
    EVEN_R: tl.constexpr,  # R % BLOCK_R == 0: every rank column of the grid exists (_out_mask)
):
    """A grid (split x rank blocks x slices, token blocks, segments)."""
    pid0 = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2)
    split = pid0 % SPLIT_K
    rblock = (pid0 // SPLIT_K) % NUM_RBLOCKS
    sl = pid0 // (SPLIT_K * NUM_RBLOCKS)  # (FUSE_SLICES: 0, the program owns them all)

    slot = tl.load(meta_ptr + T + seg)
    seg_start = tl.load(meta_ptr + T + S + seg)
    seg_len = tl.load(meta_ptr + T + 2 * S + seg)
    rank = tl.load(rank_ptr + slot)
    r0 = rblock * BLOCK_R
    m0 = pid_m * BLOCK_M
    if (r0 >= rank) | (m0 >= seg_len):
        if USE_PDL:
            # NOTE: a program that exits counts as having triggered its PDL dependents, and the fused GEMM
            # reads x before its own wait, trusting that every shrink program waited first: so wait
            # here too (a batch of base tokens only, under a CUDA graph, exits every program)
            tl.extra.cuda.gdc_wait()
        if ZERO_FILL:
            # columns past the slot's rank (a rank-0 slot: all of them) hold zeros, in every plane a reader
            # sums (plane 0 alone when the splits are summed here): decode_linear's epilogue loads no rank
            for i in tl.static_range(NUM_SLICES if FUSE_SLICES else 1):
                _store_zeros(buf_ptr, meta_ptr, seg_start, seg_len, m0, r0, split, sl + i, R, stride_bsp,
                             stride_bi, stride_bm, BLOCK_M, BLOCK_R, REDUCE, EVEN_R)  # fmt: skip
    elif FUSE_SLICES:
        _shrink_all_slices(x_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, cnt_ptr, meta_ptr, S, K, k_per_split,
                           stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_bsp, stride_bi,
                           stride_bm, R, NUM_SLICES, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, RED, REDUCE, CDT,
                           IEEE, X16, USE_PDL, EVEN_R, slot, seg, seg_start, seg_len, rank, rblock, split, pid_m)  # fmt: skip
    else:
        _shrink_one_slice(x_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, cnt_ptr, meta_ptr, S, K, k_per_split, stride_xm,
                          stride_xk, stride_as, stride_ar, stride_ak, stride_bsp, stride_bi, stride_bm, R,
                          NUM_SLICES, NUM_RBLOCKS, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, RED, REDUCE, ONE_CHUNK, CDT,
                          IEEE, X16, USE_PDL, EVEN_R, slot, seg, seg_start, seg_len, rank, rblock, split, sl, pid_m)  # fmt: skip


# The decode K block for K <= 8192 and beyond
DECODE_BLOCK_K = (256, 512)


def _fuse_decode(a_dtype: torch.dtype) -> bool:
    """At decode sizes, whether a program computes every slice of its tile (x loaded once; a third of the programs
    for qkv, half for gate_up; A loaded after the PDL wait): for half-precision A (the module's docstring)."""
    return a_dtype != torch.float32


@dataclass(frozen=True)
class PrefillTiles:
    """The launch of segments longer than 32 tokens (prefill); ``bench_lora_kernels.py --tune-prefill`` sweeps it
    at 4096 tokens.

    The pick from that sweep (H200; 4096 tokens, 8 adapters, rank 16, bf16 / fp32 LoRA weights, µs alone):
    every slice in one program, 64 x 64 tiles, 4 stages, K split to ~256 programs: qkv 24.5 / 32.4, gate_up
    22.2 / 28.3, against one slice a program at 512 programs' 25.8 / 38.1 and 23.8 / 31.3 (the least time
    summed over the four cases). Still 29-38% of copy bandwidth: x's 33.5 MB take ~24 µs where a copy would
    move them in 8. Profiled (Nsight Compute, qkv with bf16 A): 1.9 programs resident per SM of the 4 that
    fit, 13% of the warp samples before the K loop (the chain of segment, slot, rank and token loads), 21%
    after it (the split-K tail), and the loop waiting at its pipeline barrier.

    Timed back to back (one graph over many sets of inputs, no L2 flush between runs) with fp16
    A and fp16 products, 64 x 128 tiles on 3 stages, 256 programs, had the least shrink time summed over qkv /
    gate_up / o / down (71.3 µs against 74.5), but in the whole op (shrink + expand) they made qkv slower (49.2
    against 47.1 µs) and gate_up too (157.7 against 151.6), so the 2-3 slice layers keep these tiles and the
    one-slice layers took them (``PREFILL_ONE_SLICE``).
    """

    block_m: int = 64
    block_k: int = 64
    programs: int = 256  # K is split (at most K / (4 * block_k) ways) until the grid has this many
    num_warps: int = 4
    num_stages: int = 4
    fuse_slices: bool = True  # a program computes every slice (x read once) instead of one


PREFILL = PrefillTiles()
# One-slice layers (o, down) at prefill: the back-to-back sweep's pick (the whole op, fp16 weights: o 34.2 against
# 34.8 µs with 64 x 64 tiles, 512 programs, 3 stages; down 57.8 against 58.9; fp32 weights 0.4-0.7 µs slower)
PREFILL_ONE_SLICE = PrefillTiles(
    block_m=64, block_k=128, programs=256, num_warps=4, num_stages=3, fuse_slices=False
)


def _prefill_tiles(n_slices: int) -> PrefillTiles:
    return PREFILL if n_slices > 1 else PREFILL_ONE_SLICE


def _pick_blocks(
    meta: SegmentMeta,
    n_slices: int,
    n_rblocks: int,
    K: int,
    tiles: PrefillTiles,
    decode_block_k: tuple[int, int],
) -> tuple[int, int, int]:
    # (n_slices: the slices on the grid, 1 when a program computes them all)
    """(BLOCK_M, BLOCK_K, SPLIT_K): enough programs to fill the chip at decode sizes.

    Decode sizes (segments of <= 32 tokens): one K block of 256 (512 past K = 8192) per program
    (ONE_CHUNK): 128-450 programs for Llama-8B's layers with 8 adapters (a third of them for qkv, half
    for gate_up, when a program computes every slice). Larger segments
    (``tiles``): ``block_k`` K a step, K split until ``programs`` programs (at most 4 steps a split
    is left alone).
    """
    longest = meta.max_seg_len
    block_m = 16 if longest <= 16 else (32 if longest <= 32 else tiles.block_m)
    groups = n_slices * n_rblocks * triton.cdiv(longest, block_m) * meta.num_segs
    if longest <= 32:
        # NOTE: from K alone, not from how many adapters the batch has: eager steps and CUDA graphs
        # (whose static meta has a segment per slot) then split alike and sum the same partials
        block_k = decode_block_k[0] if K <= 8192 else decode_block_k[1]
        return block_m, block_k, triton.cdiv(K, block_k)
    block_k = tiles.block_k
    split = 1
    max_split = max(1, K // (4 * block_k))
    while groups * split < tiles.programs and split < max_split:
        split *= 2
    return block_m, block_k, split


def _new_buf(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The output's storage, uninitialized (a seam: tests fill it with NaN to see what is written)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def lora_shrink(
    x: torch.Tensor,
    lora_a: tuple[torch.Tensor, ...],
    meta: SegmentMeta,
    ranks: torch.Tensor,
    max_rank: int,
    block_r: int = 16,
    zero_fill: bool = False,
    decode_block_k: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x (T, K) with lora_a[i] (S, 1, R, K) -> buf (1, n_slices, T, R) fp32 = x @ A_i[slot]^T (the kernel sums its
    split-K partials itself). ``decode_block_k``: the decode K block for K <= 8192 and beyond (None:
    DECODE_BLOCK_K; benchmarks sweep it).
    ``max_rank``: the largest of ``ranks`` in use (at most R). Rows of tokens with a slot are written
    at columns r < ranks[slot], which is all ``lora_expand`` reads; with ``zero_fill`` every column (up
    to R) of those rows is, zeros past the slot's rank, so that a reader needs no rank (decode_linear's
    epilogue). Rows of tokens without a slot are never written.
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
    # zero_fill: the rank axis covers all R columns, not max_rank (programs past a slot's rank store zeros)
    n_rblocks = triton.cdiv(R if zero_fill else max(max_rank, 1), block_r)
    tiles = _prefill_tiles(n)
    fuse = n > 1 and (tiles.fuse_slices if meta.max_seg_len > 32 else _fuse_decode(a0.dtype))
    block_m, block_k, split = _pick_blocks(
        meta, 1 if fuse else n, n_rblocks, K, tiles, decode_block_k or DECODE_BLOCK_K
    )
    buf = _new_buf((split, n, T, R), x.device)
    if meta.num_segs == 0 or T == 0:
        return buf[:1]  # nothing is read
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    cdt = compute_dtype_of(x.dtype, a0.dtype)
    a1 = lora_a[1] if n > 1 else a0
    a2 = lora_a[2] if n > 2 else a0
    grid = (split * n_rblocks * (1 if fuse else n), triton.cdiv(meta.max_seg_len, block_m), meta.num_segs)
    reduce = split > 1
    cnt = buf
    if reduce:
        cnt = persistent_buffer(x.device, "lora_shrink/arrivals", n * n_rblocks * grid[1] * grid[2])
    pdl = use_pdl(x.device)
    prefill = meta.max_seg_len > 32
    launch = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages) if prefill else dict(num_warps=4)
    _lora_shrink_kernel[grid](
        x, a0, a1, a2, buf, cnt, meta.packed, ranks,
        T, meta.num_segs, K, k_per_split,
        x.stride(0), x.stride(1),
        a0.stride(0), a0.stride(2), a0.stride(3),
        buf.stride(0), buf.stride(1), buf.stride(2), R,
        NUM_SLICES=n, NUM_RBLOCKS=n_rblocks, SPLIT_K=split,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, RED=min(triton.next_power_of_2(split), 16), REDUCE=reduce,
        ONE_CHUNK=k_per_split == block_k,
        ZERO_FILL=zero_fill, FUSE_SLICES=fuse,
        CDT=tl_dtype(cdt), IEEE=cdt == torch.float32 and x.dtype == torch.float32,
        X16=prefill and cdt == torch.float32 and x.dtype == torch.bfloat16 and a0.dtype == torch.float16,
        USE_PDL=pdl, EVEN_R=R % block_r == 0, launch_pdl=pdl, **launch,
    )  # fmt: skip
    return buf[:1]
