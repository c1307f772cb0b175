"""The LoRA delta of one block of output columns for every token of a decode step, as one MMA.

    delta (BLOCK_N, BLOCK_M) = sum over slots j of B_i[j][cols] @ s_j^T,  s_j = h of the tokens in slot j, 0 elsewhere

What ``decode_linear``'s epilogue adds after its K loop, laid out transposed as its accumulator is
(columns along the MMA's M, the few tokens along its N).

NOTE: the same delta in a launch of its own after the GEMM (chained by PDL and loading B while the GEMM
ran) was measured slower (H200, Llama-8B, 32 tokens, 8 fp32 adapters: 36.4 vs 23.8 µs of LoRA cost per
layer) and was removed: the extra launch and its wait cost more than the epilogue's loads of B.

Numerics: s is rounded to the products' dtype LORA_CDT (``precision.compute_dtype``: B's, or fp32 for
fp32 B and for fp16 B with bf16 activations; the reference's intermediate is the same), multiplied in
it (tf32 for fp32 with half activations, true fp32 with LORA_IEEE), accumulated in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import dot_in, sum_planes


@triton.jit
def lora_slice(pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1,
               NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """(slice, its B, B's slot stride, first column within the slice) of column block pid_n (BLOCK_N
    divides every slice, so a block lies in one slice)."""
    # NOTE: `pid_n * 0 + c`: every branch of a runtime `if` must give a variable the same type
    col0 = pid_n * BLOCK_N
    if NUM_SLICES == 1:
        sl = pid_n * 0
        b_ptr = b0_ptr
        stride_ws = stride_ws0
        n_loc0 = col0
    else:
        if col0 < N0:
            sl = pid_n * 0
            b_ptr = b0_ptr
            stride_ws = stride_ws0
            n_loc0 = col0
        elif col0 < N0 + N1:
            sl = pid_n * 0 + 1
            b_ptr = b1_ptr
            stride_ws = stride_ws1
            n_loc0 = col0 - N0
        else:
            sl = pid_n * 0 + 2
            b_ptr = b2_ptr
            stride_ws = stride_ws2
            n_loc0 = col0 - N0 - N1
    return sl, b_ptr, stride_ws, n_loc0


@triton.jit
def lora_b_chunk(b_ptr, stride_ws, n_loc0, chunk, S, R: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, SLOTS_PER_CHUNK: tl.constexpr):  # fmt: skip
    """(BLOCK_N, C) B of slots chunk .. chunk + SLOTS_PER_CHUNK for this block's columns: column c is
    slot chunk + c // BLOCK_R, rank index c % BLOCK_R.

    NOTE: loading it through a 3-D block pointer (slots, rows, ranks), which spares a tile of 64-bit
    addresses, measured the same (H200: 24.7 vs 25.0 µs of
    LoRA cost per layer, fp32 B; 33.2 capped at 168 registers) and was removed."""
    offs_c = tl.arange(0, SLOTS_PER_CHUNK * BLOCK_R)
    c_r = offs_c % BLOCK_R
    c_j = chunk + offs_c // BLOCK_R
    loc_n = n_loc0 + tl.arange(0, BLOCK_N)
    # B's columns past a slot's rank are read unmasked along r (they multiply zeros in s)
    return tl.load(
        b_ptr + c_j[None, :] * stride_ws + loc_n[:, None] * R + c_r[None, :],
        mask=((c_r < R) & (c_j < S))[None, :],
        other=0.0,
    )


@triton.jit
def slot_columns(h_base, stride_bm, stride_bsp, slot, m_mask, chunk, n_planes, R: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, SLOTS_PER_CHUNK: tl.constexpr, RED: tl.constexpr):  # fmt: skip
    """s (BLOCK_M, C) fp32 for slots chunk .. chunk + SLOTS_PER_CHUNK: token m's s (its split-K planes
    summed) in the columns of its own slot, zeros elsewhere (and past R). h_base: the shrink's buf at
    (plane 0, this slice, token 0, rank 0).

    A gather: each column loads its token's rank c % BLOCK_R only where the token's slot is the column's,
    so that tokens without a slot (-1) load nothing, whatever their rows hold (NaN included).
    NOTE: loading each token's h (BLOCK_M, BLOCK_R), broadcast to the chunk's columns and selected, was the
    first form; Nsight Compute showed that epilogue at ~640
    instructions a warp with one warp per scheduler, nothing to hide their latency, and the B load's
    shared-memory store waiting before h's loads were issued (two round trips).
    """
    offs_c = tl.arange(0, SLOTS_PER_CHUNK * BLOCK_R)
    c_r = offs_c % BLOCK_R
    c_j = chunk + offs_c // BLOCK_R
    offs_m = tl.arange(0, BLOCK_M)
    mask = (m_mask[:, None] & (slot[:, None] == c_j[None, :])) & (c_r < R)[None, :]
    return sum_planes(h_base + offs_m[:, None] * stride_bm + c_r[None, :], mask, n_planes, stride_bsp, RED, False)


@triton.jit
def expand_chunk(delta, b, sx, LORA_CDT: tl.constexpr, LORA_IEEE: tl.constexpr):
    """delta (BLOCK_N, BLOCK_M) += B_chunk sx^T, sx (BLOCK_M, C) from ``slot_columns``."""
    sx = sx.to(LORA_CDT)  # in the products' dtype, as the reference's intermediate is (precision.py)
    delta += dot_in(b, tl.trans(sx), LORA_CDT, LORA_IEEE)
    return delta


@triton.jit
def block_delta(
    pid_n, M, buf_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, S, SPLIT_K, N0, N1,
    stride_bsp, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
    R: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, SLOTS_PER_CHUNK: tl.constexpr, RED: tl.constexpr,
    LORA_CDT: tl.constexpr, LORA_IEEE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """delta (BLOCK_N, BLOCK_M) fp32 of column block pid_n for tokens 0..M-1 (zero for tokens of no slot).

    buf: the shrink's (SPLIT_K, n_slices, M, R) fp32 partials, every column written for the tokens with a
    slot (zeros past its rank), read after the PDL wait (USE_PDL). The slots (mapping, written before the
    forward) are loaded before it; s and then B after it, so that both loads are in flight before the
    first of them is used (B's store into shared memory for the MMA waits for B: issued first, it held
    back s's loads by a round trip, as Nsight Compute showed; half-precision B was pulled into L2 during the K loop,
    fp32 B is not by default: ``prefetch_ahead``).
    """
    sl, b_ptr, stride_ws, n_loc0 = lora_slice(
        pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, NUM_SLICES, BLOCK_N
    )
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int32)  # (BLOCK_M,)
    if USE_PDL:
        # launched while the shrink runs: its buf is read only after it has finished
        tl.extra.cuda.gdc_wait()
    # NOTE: the whole chunk of slots is ONE load of B and ONE MMA: s is expanded to (tokens, slots x r)
    # with zeros outside each token's own slot, so each token meets only its own B. A loop of one
    # small MMA per slot paid a DRAM round trip per slot in every wave of programs (LoRA cost of gate_up,
    # 3.4 waves: 24 µs, then 14 with this; o, one wave: 7.0, then 5.8; H200, 32 tokens, 8 slots).
    delta = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    h_base = buf_ptr + sl * stride_bi
    # NOTE: num_stages=1: the kernel's num_stages would software-pipeline this loop too (5 buffers of s and B
    # in shared memory, 240 KB for qkv: OutOfResources on the H200)
    for chunk in tl.range(0, S, SLOTS_PER_CHUNK, num_stages=1):
        sx = slot_columns(h_base, stride_bm, stride_bsp, slot, m_mask, chunk, SPLIT_K, R, BLOCK_M, BLOCK_R, SLOTS_PER_CHUNK, RED)
        b = lora_b_chunk(b_ptr, stride_ws, n_loc0, chunk, S, R, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK)
        delta = expand_chunk(delta, b, sx, LORA_CDT, LORA_IEEE)
    return delta


# The most columns of (slot, r) per MMA of the epilogue. Fewer columns, more chunks (a round trip each), but
# fewer registers: compiled for sm_90 (benchmarks/gpu/kernel_resources.py), decode_linear's LoRA variant took
# 157-166 registers at 128 columns (fp32 B), 112-124 at 64, 80-94 at 32, none spilled; its pipeline's shared
# memory (96-120 KB) is what limits the programs per SM, with or without LoRA. Timed on the H200 (8 fp32 slots,
# LoRA cost per layer): 25.0 µs at 128, 24.3 at 64, 31.9 at 32 (the 8-adapter step 5.76 vs 5.55 ms).
MMA_COLUMNS = 128


def slots_per_chunk(n_slots: int, block_r: int) -> int:
    """Slots per MMA of ``block_delta``: up to MMA_COLUMNS columns of (slot, r), at least one slot."""
    return max(1, min(triton.next_power_of_2(n_slots), MMA_COLUMNS // block_r))
