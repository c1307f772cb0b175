"""The decode GEMM's Triton kernel, with its LoRA epilogue (``layers/triton_decode_linear`` launches it; its docstring says what
it computes and why): a K loop over a block of W's rows (or, past W's blocks, of A's rows: ``shrink_into``), split-K
with a deterministic sum, and the epilogue that adds the LoRA delta (``expand_block.block_delta``)."""

from __future__ import annotations

import triton
import triton.language as tl

from loraserve.lora.ops.triton.expand_block import block_delta, lora_slice
from loraserve.lora.ops.triton.utils import dot_in, prefetch_l2


@triton.jit
def _epilogue(
    acc,
    pid_n,
    bias_ptr,
    y_ptr,
    M,
    N,
    stride_ym,
    buf_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    slots_ptr,
    S,
    SPLIT_K,
    N0,
    N1,
    stride_bsp,
    stride_bi,
    stride_bm,
    stride_ws0,
    stride_ws1,
    stride_ws2,
    R: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_CHUNK: tl.constexpr,
    RED: tl.constexpr,
    LORA_CDT: tl.constexpr,
    LORA_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """acc (BLOCK_N, BLOCK_M) fp32 = W x^T of this program's columns -> + bias, rounded, + LoRA, stored."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_dt = y_ptr.dtype.element_ty
    y = acc.to(out_dt)  # (BLOCK_N, BLOCK_M): the base output, rounded as cuBLAS's would be

    if HAS_LORA:
        # NOTE: slots and B are loaded here, after the K loop: loaded before it (held in registers
        # across the loop) they cost gate_up 21.4 instead of 12.8 µs of LoRA (H200, 8 slots)
        delta = block_delta(
            pid_n, M, buf_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, S, SPLIT_K, N0, N1,
            stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
            R, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK, RED, LORA_CDT, LORA_IEEE, USE_PDL,
        )  # fmt: skip
        y = (y.to(tl.float32) + delta).to(out_dt)

    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, y, mask=n_mask[:, None] & m_mask[None, :])


@triton.jit
def _prefetch_w(src_ptr, row0, n_rows, k_lo, k_hi, stride_wn, BLOCK_N: tl.constexpr, LINES: tl.constexpr,
                PER_LINE: tl.constexpr):  # fmt: skip
    """Pull into L2 this program's rows of W (or of A: the shrink's blocks) over its K range, a prefetch a 128-byte
    line (``w_prefetch_lines``); addresses clamped to the rows and the K range (no prefetch past them)."""
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), n_rows - 1)
    ks = tl.minimum(k_lo + tl.arange(0, LINES) * PER_LINE, k_hi - 1)
    prefetch_l2(src_ptr + rows[:, None].to(tl.int64) * stride_wn + ks[None, :])


@triton.jit
def _prefetch_b(pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, S, R: tl.constexpr,
                NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr, PF_SLOTS: tl.constexpr, PF_LINES: tl.constexpr):  # fmt: skip
    """Pull into L2 the B that this column block's epilogue will load (every slot's BLOCK_N x R, contiguous
    per slot), so that the epilogue meets L2's latency, not DRAM's."""
    sl, b_ptr, stride_ws, n_loc0 = lora_slice(
        pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, NUM_SLICES, BLOCK_N
    )
    per_line: tl.constexpr = BLOCK_N * R // PF_LINES  # elements of B per 128-byte line
    offs = tl.arange(0, PF_SLOTS * PF_LINES)
    j = tl.minimum(offs // PF_LINES, S - 1)
    prefetch_l2(b_ptr + j.to(tl.int64) * stride_ws + n_loc0 * R + (offs % PF_LINES) * per_line)


@triton.jit
def _k_loop(x_ptr, w_ptr, row0, N, k_lo, k_hi, M, stride_xm, stride_wn, b0_ptr, b1_ptr, b2_ptr, stride_ws0,
            stride_ws1, stride_ws2, N0, N1, S, R: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
            CDT: tl.constexpr, IEEE: tl.constexpr, PF_AHEAD: tl.constexpr, PF_SLOTS: tl.constexpr,
            PF_LINES: tl.constexpr, x_k_base, x_shift, X_SHIFT: tl.constexpr):  # fmt: skip
    """acc (BLOCK_N, BLOCK_M) fp32 = rows [row0, row0 + BLOCK_N) of w (N rows) times x^T over K in [k_lo, k_hi),
    products in CDT; (PF_AHEAD) PF_AHEAD steps before the end, pull the epilogue's B into L2. (X_SHIFT) from
    column x_k_base on (a multiple of BLOCK_K), x is read x_shift columns further on (``in_k``)."""
    pid_n = row0 // BLOCK_N
    offs_n = row0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PF_AHEAD > 0:  # the K step at which this program pulls its epilogue's B into L2
        k_pf = k_lo + tl.maximum(tl.cdiv(k_hi - k_lo, BLOCK_K) - PF_AHEAD, 0) * BLOCK_K
    for k in range(k_lo, k_hi, BLOCK_K):
        if X_SHIFT:  # x's address from the step's K (a select, not a branch: the loads stay pipelined)
            x_ptrs = (
                x_ptr
                + offs_m[:, None] * stride_xm
                + (k + tl.where(k >= x_k_base, x_shift, 0) + offs_k)[None, :]
            )
        if PF_AHEAD > 0:
            if k == k_pf:
                _prefetch_b(pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, S,
                            R, NUM_SLICES, BLOCK_N, PF_SLOTS, PF_LINES)  # fmt: skip
        if EVEN_K:
            if EVEN_N:
                w = tl.load(w_ptrs)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += dot_in(w, tl.trans(xt), CDT, IEEE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_shrink(acc, row0, s_ptr, M, stride_sm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The shrink's columns [row0, row0 + BLOCK_N) of every token: acc (BLOCK_N, BLOCK_M) fp32, stored unrounded."""
    offs_n = row0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(s_ptr + offs_m[None, :] * stride_sm + offs_n[:, None], acc, mask=(offs_m < M)[None, :])


@triton.jit
def _finish(acc, pid_n, bias_ptr, y_ptr, M, N, stride_ym, s_ptr, NB_W, stride_sm, buf_ptr, b0_ptr, b1_ptr, b2_ptr,
            slots_ptr, S, SPLIT_K, N0, N1, stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
            R: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_SHRINK: tl.constexpr,
            NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
            SLOTS_PER_CHUNK: tl.constexpr, RED: tl.constexpr, LORA_CDT: tl.constexpr, LORA_IEEE: tl.constexpr,
            USE_PDL: tl.constexpr):  # fmt: skip
    """A column block's complete acc: the shrink's columns stored as they are (HAS_SHRINK, blocks past W's),
    or W's through ``_epilogue``."""
    shrink_block = False  # a compile-time False without HAS_SHRINK: the plain kernel has no branch
    if HAS_SHRINK:
        shrink_block = pid_n >= NB_W
    if shrink_block:
        _store_shrink(acc, (pid_n - NB_W) * BLOCK_N, s_ptr, M, stride_sm, BLOCK_M, BLOCK_N)
    else:
        _epilogue(
            acc, pid_n, bias_ptr, y_ptr, M, N, stride_ym, buf_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr,
            S, SPLIT_K, N0, N1, stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
            R, HAS_BIAS, HAS_LORA, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK, RED,
            LORA_CDT, LORA_IEEE, USE_PDL,
        )  # fmt: skip


# NOTE: sizes are specialized (not do_not_specialize): Triton then knows K and the strides are multiples
# of 16 and vectorizes the loads; only M (the token count) is a runtime value.
@triton.jit(do_not_specialize=["M", "S", "SPLIT_K"])
def decode_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    ws_ptr,  # fp32 (SPLIT_W, n_blocks, BLOCK_N, BLOCK_M): split-K partials (SPLIT_W > 1)
    cnt_ptr,  # int32 (n_blocks,): arrivals per column block, zero between launches (SPLIT_W > 1)
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    # the shrink's columns (HAS_SHRINK; else placeholders): A's rows (NA, K) in W's dtype and row stride, s (M, NA) fp32
    a_ptr,
    s_ptr,
    NB_W,  # column blocks of W (cdiv(N, BLOCK_N)); blocks past them are the shrink's
    NA,  # the shrink's columns, a multiple of BLOCK_N (0 without HAS_SHRINK)
    stride_sm,
    # LoRA expand epilogue (unused when not HAS_LORA)
    buf_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    slots_ptr,
    S,
    SPLIT_K,
    N0,
    N1,
    stride_bsp,
    stride_bi,
    stride_bm,
    stride_ws0,
    stride_ws1,
    stride_ws2,
    R: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    HAS_SHRINK: tl.constexpr,  # extra programs compute x A^T (``shrink_into``), beside W's
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_CHUNK: tl.constexpr,
    RED: tl.constexpr,
    SPLIT_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
    LORA_CDT: tl.constexpr,
    LORA_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_CHAIN: tl.constexpr,  # a link of the step's PDL chain (utils.pdl_chain)
    WAIT_FIRST: tl.constexpr,  # (PDL_CHAIN) wait for the kernel before us before reading x
    TRIGGER_AFTER_WAIT: tl.constexpr,  # (WAIT_FIRST) let our dependent launch only once that wait returned
    PF_AHEAD: tl.constexpr,  # (HAS_LORA) K steps before the loop's end at which B is pulled into L2 (0: never)
    PF_SLOTS: tl.constexpr,  # slots whose B is pulled (a power of 2 >= S)
    PF_LINES: tl.constexpr,  # 128-byte lines of one slot's B for this block's columns (a power of 2)
    W_PF_LINES: tl.constexpr,  # (WAIT_FIRST) 128-byte lines along K of each of our rows pulled into L2 before the wait (0: none)
    W_PER_LINE: tl.constexpr,  # elements of W in 128 bytes
    # (``in_k``) rows from x_shift_row on read x's columns past x_k_base x_shift columns further on
    x_k_base,
    x_shift_row,
    x_shift,
    X_SHIFT: tl.constexpr,
):
    tl.static_assert(
        (W_PF_LINES == 0 and not TRIGGER_AFTER_WAIT) or WAIT_FIRST,
        "W's prefetch and the trigger after the wait are for a link that waits before its K loop",
    )
    pid = tl.program_id(0)
    if PDL_CHAIN and not TRIGGER_AFTER_WAIT:  # a link of the chain: our dependent may launch now
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT_W == 1:
        pid_n = pid
        k_lo = pid * 0
    else:
        pid_n = pid // SPLIT_W
        k_lo = (pid % SPLIT_W) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    # the rows this program streams: W's, or (HAS_SHRINK, blocks past W's) the shrink's, A's rows in W's dtype
    # and row stride, so that one K loop serves both (the same registers and shared memory as the plain GEMM)
    src_ptr = w_ptr
    row0 = pid_n * BLOCK_N
    n_rows = N
    if HAS_SHRINK:
        if pid_n >= NB_W:
            src_ptr = a_ptr
            row0 = (pid_n - NB_W) * BLOCK_N
            n_rows = NA
    if PDL_CHAIN:
        if W_PF_LINES > 0:  # our rows of W (weights) pulled into L2 before the wait
            _prefetch_w(src_ptr, row0, n_rows, k_lo, k_hi, stride_wn, BLOCK_N, W_PF_LINES, W_PER_LINE)
        if WAIT_FIRST:
            tl.extra.cuda.gdc_wait()
        if TRIGGER_AFTER_WAIT:  # our dependent may read what the kernel before us wrote before its own wait
            tl.extra.cuda.gdc_launch_dependents()
    acc = _k_loop(x_ptr, src_ptr, row0, n_rows, k_lo, k_hi, M, stride_xm, stride_wn, b0_ptr, b1_ptr, b2_ptr,
                  stride_ws0, stride_ws1, stride_ws2, N0, N1, S, R, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_K,
                  EVEN_K, EVEN_N, CDT, IEEE, PF_AHEAD, PF_SLOTS, PF_LINES, x_k_base,
                  tl.where(row0 >= x_shift_row, x_shift, 0), X_SHIFT)  # fmt: skip

    if SPLIT_W == 1:
        _finish(
            acc, pid_n, bias_ptr, y_ptr, M, N, stride_ym, s_ptr, NB_W, stride_sm, buf_ptr, b0_ptr, b1_ptr, b2_ptr,
            slots_ptr, S, SPLIT_K, N0, N1, stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
            R, HAS_BIAS, HAS_LORA, HAS_SHRINK, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK, RED,
            LORA_CDT, LORA_IEEE, USE_PDL,
        )  # fmt: skip
    else:
        # Serial split-K: every split writes its partial to its own plane; the last of a column block to
        # arrive sums the planes in plane order (deterministic, whoever is last) and finishes the block.
        # NOTE: CUTLASS's semaphore pattern: all threads' stores, a CTA barrier, then one acq_rel atomic
        # at GPU scope publishes them; the last arrival reads the planes past L1 (.cg), which is not
        # coherent across SMs, and puts the counter back to zero for the next launch.
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        plane = (NB_W + NA // BLOCK_N) * (BLOCK_N * BLOCK_M)  # elements of one split's plane
        tl.store(ws_ptr + (pid % SPLIT_W) * plane + pid_n * (BLOCK_N * BLOCK_M) + tile, acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_W - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_W):
                total += tl.load(
                    ws_ptr + sp * plane + pid_n * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg"
                )
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            _finish(
                total, pid_n, bias_ptr, y_ptr, M, N, stride_ym, s_ptr, NB_W, stride_sm, buf_ptr, b0_ptr, b1_ptr,
                b2_ptr, slots_ptr, S, SPLIT_K, N0, N1, stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1,
                stride_ws2, R, HAS_BIAS, HAS_LORA, HAS_SHRINK, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R,
                SLOTS_PER_CHUNK, RED, LORA_CDT, LORA_IEEE, USE_PDL,
            )  # fmt: skip
    if USE_PDL:
        if not HAS_LORA:
            # (after_shrink) we read none of the shrink's output, but our dependents do: wait for it before
            # ending, so that our completion, which is what they wait for, implies the shrink's
            tl.extra.cuda.gdc_wait()
