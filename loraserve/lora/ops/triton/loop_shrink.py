"""The LoRA shrink computed inside ``decode_linear``'s K loop, as a few extra rows of its GEMM.

    s[t, i, r] = x[t] @ A_i[slot(t), r]^T     for the tokens of every adapter in the batch

Why: the shrink as a launch of its own costs the decode step a launch that the GEMM after it must
wait for (the GEMM can only be launched once every shrink program has waited for the kernel before;
BENCHMARKS.md sessions 6-9). Here there is no shrink launch: the GEMM is a plain link of the step's
PDL chain, and its first programs each stream one unit of A beside their tile of W, over a chunk of
their K range, reading the x tile they already load.

The units: for each adapter slot present in the batch (``active_slots``, from the per-token slots),
each slice and each block of 16 ranks, one (16, K) block of A; the K range of each GEMM split is cut in
``C`` chunks so that ``units x C x splits`` programs (at most ``holders``, no more than one per SM)
share the work. A unit's result is a (16 ranks, tokens) tile of x @ A^T over its chunk, stored only
for the tokens of its slot, in plane ``split * C + chunk`` of ``buf``; the epilogue sums the planes.

Roles are taken by arrival ticket (CUDA does not promise to start programs in id order): the first
programs to start hold the units, so every unit holder is resident before any program waits for the
holders in its epilogue, and none waits for one that cannot start (the holders, at most one per SM,
wait only after they have published their unit). Units of A past a slot's rank are masked (zeros).
"""

from __future__ import annotations

import triton
import triton.language as tl

# (constexpr: the kernels read them)
ROWS = tl.constexpr(16)  # ranks per unit: the MMA's smallest M
MAX_PLANES = tl.constexpr(16)  # chunks x splits of one launch (the epilogue sums them in one round of loads)


@triton.jit
def active_slots(slots_ptr, M, BLOCK_M: tl.constexpr):
    """(slots (BLOCK_M,), first (BLOCK_M,) bool, index (BLOCK_M,), n_active): each token's slot (-1 past
    M), whether it is the first token of its slot (slot >= 0), the number of first tokens before it, and
    how many distinct slots the batch has. The j-th distinct slot is the slot of the first token with
    index j."""
    offs = tl.arange(0, BLOCK_M)
    slots = tl.load(slots_ptr + offs, mask=offs < M, other=-1).to(tl.int32)
    same_before = (slots[:, None] == slots[None, :]) & (offs[None, :] < offs[:, None])
    first = (slots >= 0) & (tl.sum(same_before.to(tl.int32), axis=1) == 0)
    index = tl.cumsum(first.to(tl.int32), axis=0) - 1
    return slots, first, index, tl.sum(first.to(tl.int32), axis=0)


@triton.jit
def unit_of(ticket, slots, first, index, n_active, rank_ptr, steps, HOLD_PER_SPLIT,
            NUM_SLICES: tl.constexpr, RBLOCKS: tl.constexpr, MAX_CHUNKS: tl.constexpr):  # fmt: skip
    """The unit of the program with this ticket within its split: (holds a unit, slot, slice, first rank,
    the slot's rank, chunk, chunks). ``steps``: K steps per split."""
    n_units = n_active * NUM_SLICES * RBLOCKS
    chunks = tl.minimum(tl.minimum(steps, MAX_CHUNKS), HOLD_PER_SPLIT // tl.maximum(n_units, 1))
    chunks = tl.maximum(chunks, 1)
    holds = ticket < n_units * chunks
    u = ticket % tl.maximum(n_units, 1)
    chunk = ticket // tl.maximum(n_units, 1)
    j = u // (NUM_SLICES * RBLOCKS)
    sl = (u // RBLOCKS) % NUM_SLICES
    r0 = (u % RBLOCKS) * ROWS
    slot = tl.sum(tl.where(first & (index == j), slots, 0), axis=0)
    rank = tl.load(rank_ptr + slot, mask=holds, other=0)
    return holds, slot, sl, r0, rank, chunk, chunks


@triton.jit
def store_unit(acc_s, buf_ptr, plane, sl, r0, slot, slots, M, R, stride_bsp, stride_bi, stride_bm,
               BLOCK_M: tl.constexpr):  # fmt: skip
    """acc_s (ROWS, BLOCK_M) -> buf[plane, sl, t, r0:r0 + ROWS] for the tokens t of this unit's slot."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = r0 + tl.arange(0, ROWS)
    mine = (offs_m < M) & (slots == slot)
    ptrs = buf_ptr + plane * stride_bsp + sl * stride_bi + offs_m[None, :] * stride_bm + offs_r[:, None]
    tl.store(ptrs, acc_s, mask=(offs_r < R)[:, None] & mine[None, :])


def max_units(tokens: int, n_slots: int, n_slices: int, rank_cols: int) -> int:
    """The most units a batch of ``tokens`` can have (every token in its own slot)."""
    return min(tokens, n_slots) * n_slices * triton.cdiv(rank_cols, ROWS.value)
