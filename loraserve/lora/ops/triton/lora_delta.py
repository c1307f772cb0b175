"""The LoRA delta of a decode step, computed in the shrink's launch while the GEMM streams W.

    d (M, N) fp32 = per token t: B_i[slot(t)] (s_i[t])      (slice i owns columns [off_i, off_i + N_i))

``lora_shrink(..., delta=DeltaTarget(...))`` appends programs to its grid (its last ones, so they are
dispatched after every shrink program and never starve one: no deadlock) that pull their blocks' B,
trigger the GEMM's launch, spin until every shrink program has counted itself done, then compute each
block's delta exactly as ``decode_linear``'s epilogue would (``expand_block.block_delta``, the same
tiles: the same bits) and store it. The GEMM (``ExpandEpilogue(delta=d)``) then only loads and adds it
after its K loop: one load instead of B, buf, an MMA.

Why: at decode sizes most of a LoRA'd op's cost is that epilogue (on a ready buffer 1.6-1.8 µs for qkv,
o and down, whose bytes take 0.3; H200, session 12): every program of a one-wave GEMM pays it after
its K loop, where nothing hides it. Here it runs beside the K loop. Off by default until timed
(``PRECOMPUTED_DELTA``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.expand_block import block_delta, slots_per_chunk
from loraserve.lora.ops.triton.utils import compute_dtype_of, tl_dtype

# Knob (a module attribute: bench_decode_linear.py --matrix sweeps it; LORASERVE_PRECOMPUTED_DELTA=1 turns it on)
PRECOMPUTED_DELTA: bool = os.environ.get("LORASERVE_PRECOMPUTED_DELTA", "0") == "1"
DELTA_PROGRAMS = 64  # about this many delta programs (whole z-planes of the shrink's grid)
# the shrink kernel's parameters that DeltaTarget.args fills, then its counters
DELTA_ARG_NAMES = ("d_ptr", "b0_ptr", "b1_ptr", "b2_ptr", "slots_ptr", "n_slots", "N", "N0", "N1", "stride_ws0",
                   "stride_ws1", "stride_ws2", "n_blocks", "done_ptr")  # fmt: skip


@dataclass
class DeltaTarget:
    """Where and how the shrink's launch writes the delta: d (M, N) fp32 contiguous; lora_b per slice
    (S, 1, N_i, R) contiguous; token_slots (M,) int (-1 = base); the GEMM's column block and token
    block (``decode_linear``'s tiles, so that the delta has the epilogue's bits)."""

    d: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    token_slots: torch.Tensor
    block_n: int
    block_m: int

    def args(self) -> tuple:
        """The kernel's delta arguments, after the shrink's own."""
        b0 = self.lora_b[0]
        n_sl = len(self.lora_b)
        b1 = self.lora_b[1] if n_sl > 1 else b0
        b2 = self.lora_b[2] if n_sl > 2 else b0
        sizes = [b.shape[2] for b in self.lora_b]
        N = sum(sizes)
        assert self.d.shape == (self.token_slots.shape[0], N) and self.d.dtype == torch.float32
        assert self.d.is_contiguous() and all(n % self.block_n == 0 for n in sizes)
        return (self.d, b0, b1, b2, self.token_slots, b0.shape[0], N, sizes[0], sizes[1] if n_sl > 1 else 0,
                b0.stride(0), b1.stride(0), b2.stride(0), N // self.block_n)  # fmt: skip

    def consts(self) -> dict:
        b0 = self.lora_b[0]
        block_r = max(16, triton.next_power_of_2(b0.shape[3]))
        lcdt = compute_dtype_of(torch.float32 if b0.dtype == torch.float32 else b0.dtype, b0.dtype)
        per_chunk = slots_per_chunk(b0.shape[0], block_r)
        if b0.dtype == torch.float32:
            # NOTE: an MMA over 128 columns of fp32 B takes 112 KB of shared memory (compiled for sm_90), which
            # the whole shrink launch would then reserve per program, keeping the GEMM's programs off its
            # SMs; over 32 columns, 32 KB. (The sum over chunks is then in another order than the epilogue's.)
            per_chunk = max(1, min(per_chunk, 32 // block_r))
        # (LORA_IEEE off: decode_linear serves half-precision activations only, where its epilogue's is off)
        return dict(
            D_R=b0.shape[3], D_BLOCK_M=self.block_m, D_BLOCK_N=self.block_n, D_BLOCK_R=block_r,
            D_SLOTS_PER_CHUNK=per_chunk, LORA_WDT=tl_dtype(b0.dtype),
            LORA_CDT=tl_dtype(lcdt), LORA_IEEE=False,
        )  # fmt: skip


NO_DELTA_CONSTS = dict(D_R=16, D_BLOCK_M=16, D_BLOCK_N=16, D_BLOCK_R=16, D_SLOTS_PER_CHUNK=1, LORA_WDT=tl.float32,
                       LORA_CDT=tl.float32, LORA_IEEE=False)  # fmt: skip


@triton.jit
def delta_programs(
    e, n_e, done_ptr, n_shrink, buf_ptr, stride_bi, stride_bm,
    d_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, n_slots, T, N, N0, N1, stride_ws0, stride_ws1, stride_ws2, n_blocks,
    R: tl.constexpr, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOTS_PER_CHUNK: tl.constexpr, LORA_WDT: tl.constexpr, LORA_CDT: tl.constexpr, LORA_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Delta program e of n_e: blocks e, e + n_e, ... < n_blocks, once the n_shrink shrink programs
    have counted themselves done (done_ptr[0]); the last delta program to finish its spin puts both
    counters (done_ptr[0], done_ptr[1]) back to zero for the next launch."""
    if USE_PDL:
        # we read nothing of the kernel before (buf comes from this launch, after the count); the GEMM
        # may launch once every program has triggered (the shrink programs do after their wait)
        tl.extra.cuda.gdc_launch_dependents()
    while tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu") < n_shrink:
        pass
    if tl.atomic_add(done_ptr + 1, 1, sem="relaxed", scope="gpu") == n_e - 1:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(done_ptr + 1, 0, sem="relaxed", scope="gpu")
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    for blk in range(e, n_blocks, n_e):
        # buf's single plane (the shrink summed its splits), read past L1: other SMs wrote it in this launch
        delta = block_delta(
            blk, T, buf_ptr, b0_ptr, b1_ptr, b2_ptr, slots_ptr, n_slots, 1, N0, N1,
            0, stride_bi, stride_bm, stride_ws0, stride_ws1, stride_ws2,
            R, NUM_SLICES, BLOCK_M, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK, 1, LORA_WDT, LORA_CDT, LORA_IEEE, False, True,
        )  # fmt: skip
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(d_ptr + offs_m[None, :] * N + offs_n[:, None], delta, mask=(offs_n < N)[:, None] & m_mask[None, :])
