"""A linear layer at decode sizes (<= 32 tokens) on the GPU, with an optional per-token low-rank
epilogue: the LoRA expand, in the same launch as the GEMM.

    y = round(x @ W^T + bias) + sum_i B_i[slot(t)] (s_i[t])      (slice i owns columns [off_i, off_i + N_i))

where ``s`` is ``lora_shrink``'s output (x @ A_i[slot(t)]^T in fp32, as split-K planes that are summed here,
or already summed by the shrink: one plane, the engine's default). The base
layers call it without the epilogue where it beats cuBLAS (``prefer_over_cublas``); the LoRA layers
call it with the epilogue (lora/ops/triton_ops.py), or, for a small model's gate_up, without it as the
shrink's dependent (``after_shrink``) with the delta added in SiLU-and-mul (lora/ops/triton/gated_lora.py).

Why: at decode sizes a LoRA'd op was three launches (cuBLAS GEMM, shrink, expand), and the two LoRA
kernels cost ~10-15 µs per op on the H200 whatever they moved: launch and latency, not bytes. Here the
expand rides on the GEMM that already streams W: each program, after its K loop over its BLOCK_N rows
of W, adds the delta of those columns (``expand_block.block_delta``). The shrink stays a launch of its
own before the GEMM; under programmatic dependent launch (Hopper) the GEMM starts while the shrink
runs, streams W, and waits (``gdc_wait``) only before reading the shrink's partials. Either way the
kernel is a link of the decode step's PDL chain (``utils.pdl_chain``): it lets its dependent launch
at once; as the shrink's dependent (with the epilogue, or ``after_shrink``) it reads x at once, the
shrink having waited for x, and waits at the epilogue (or, after_shrink, at its end, so that its own
completion implies the shrink's); otherwise it waits for the kernel before it before reading x.

NOTE: the shrink inside this launch was tried (session 6, commit 71c6a33): the first programs, at most
one per SM, computed the shrink's units before their K loop and published them through an atomic
counter that every program waited on after its own K loop (with a fallback against starvation). It
removed a launch per op but measured slower (H200, Llama-8B shapes, 32 tokens, 8 fp32 adapters: 42
vs 31 µs of LoRA cost per layer; the 8-adapter step 6.34 vs 5.97 ms): the units' loads of A delayed the
first wave's stream of W, where a shrink launch's A loads overlap the previous kernel's tail. It was
removed; a GEMM whose warps specialize (some stream W while others run the shrink) could revive it.

NOTE: three more were measured slower and removed in session 8 (H200, Llama-8B shapes, 32 tokens, 8 fp32
adapters; LoRA cost per layer from ``--matrix``, 8-adapter step from bench_e2e, BENCHMARKS.md session 8):
- the delta as more K columns of the GEMM (commit 2fab3e5): B packed per layer as bf16 hi + lo columns,
  the shrink writing s over every slot's columns, one pipelined loop over W then B. The columns on a
  ready s cost less where a block is one program (qkv 2.3, gate_up 5.5 µs, against this epilogue's 2.8
  and 8.0), more under split-K (o 6.1, down 7.7), and reading s inside the pipelined loop forces the
  GEMM to wait for the whole shrink first (4.4-6.5 µs an op): 45.0 µs per layer, a 6.32 ms step
  against 5.55 in the same call;
- each LoRA'd program pulling its epilogue's B into L2 before its K loop (commit cf605f9): 29.4 vs 24.8
  µs per layer, 5.72 vs 5.55 ms (not profiled; probably the prefetches compete with the stream of W);
- the GEMM launched as soon as the shrink starts, spinning on an x-ready flag raised by the shrink's
  first program (commit a392f5b): 5.71 vs 5.56 ms (not profiled; its spinning programs hold SMs while
  the shrink runs).

NOTE: the shrink as this launch's first programs (session 9, commit 8047943; the GEMM then a plain link
of the PDL chain, its epilogue spinning until the shrink's programs were done) measured slower: 33.7 vs
24.9 µs of LoRA cost per layer, the step 1.23x vs 1.16x the base (only gate_up, whose K loop is long,
gained: 8.4 vs 9.2 µs). Each shrink program held this kernel's shared memory (120 KB, a whole SM;
benchmarks/gpu/kernel_resources.py), so the short GEMMs' programs spilled into a second wave. Removed.

NOTE: the shrink inside this kernel's K loop (session 10, commit f17a878; no shrink launch at all: the
first programs by arrival ticket each streamed one (16 ranks, K chunk) unit of A beside their W, one
per SM at most, and every epilogue spun until the units were published) was correct (parity and
greedy ids as the default) and slower: graph period per op with bf16 LoRA weights qkv 21.9 vs 18.8 µs,
gate_up 74.1 vs 63.5; the 8-adapter step 1.52x the base (bf16 weights 1.24x). Kernel timestamps of the
default path (``bench_decode_linear.py --trace``) show why a launch of its own is cheap here: the GEMM
starts within 0.4 µs of the kernel before it ending, and the shrink runs beside its K loop. Most of
the LoRA cost is this epilogue (on a ready buffer 11.6 of 17.8 µs a layer, bf16 B), which waits on its
loads after the K loop.

NOTE: the delta computed inside the K loop a few steps before its end (session 10, commit 36c8ce0; under
split-K by split 0, through a plane of the partials), so that its loads wait behind the last steps' W
instead of after the loop, measured slower: 22.7 vs 16.3 µs of LoRA cost per layer with bf16 B (qkv 5.5
vs 2.9), 31.6 vs 24.3 with fp32 B. Compiled for sm_90 the loop kept its 5-stage pipeline, but the
delta's MMA operands took shared memory of their own (144-168 KB a program). Removed.

NOTE: under split-K, every split computing its delta before its arrival (session 11, commit 0088130), so
that the last arrival's round trips (its arrival, then the partials) overlap the delta's loads, measured
slower with bf16 B (--matrix, LoRA cost: o 4.1 vs 3.2-3.4 µs, down 5.9 vs 4.2-4.4 in session 10's calls)
and about the same with fp32 B (o 4.4 vs 4.5, down 6.0 vs 6.2). Removed.

NOTE: helper programs for a GEMM of several waves (session 12, commit 47671fa; gate_up: 448 blocks, 264
slots, 80 idle in the second wave): the first wave's blocks stored their base output and a ready flag
and left, and helpers (the grid's last programs, on the last wave's idle slots) added those deltas while
the second wave streamed W, so that only the last wave waited on an epilogue. Same bits as the epilogue
(interpreter and GPU tests); slower (--matrix, gate_up's LoRA cost 6.5 vs 5.9 µs with bf16 B, 9.5 vs 9.0
with fp32 B) and the same end to end (8-adapter step 5.29 vs 5.30 ms with bf16 weights, 5.55 vs 5.56
fp32, in the same call): the first wave's epilogue is not what the op waits on. Removed.

NOTE: the delta precomputed in the shrink's launch (session 12, commit c61824c): the shrink's 1-D grid
ended in ~64 delta programs that pulled B, spun until every shrink program had counted itself done,
and wrote each column block's delta (fp32, the epilogue's tiles) while the GEMM streamed W; the GEMM's
epilogue only loaded and added it. Same bits as the epilogue in the interpreter. --matrix: the same
LoRA cost (bf16 B 16.4 vs 16.5 µs a layer, fp32 25.2 vs 24.8; every op within 0.3 µs), so the epilogue's
MMA after the loop was not what the op waited on either; end to end slower (8-adapter step 6.00 vs 5.52
ms fp32, 5.62 vs 5.26 bf16; the shrink launches 15.2 vs 6.6 µs each in the eager profile, its delta
programs spinning on SMs the step's other kernels wanted) and, with bf16 weights under graphs, parity
vs HF + PEFT broke (1.62; not investigated). Removed.

NOTE: the GEMM launched as its shrink starts (session 12, commit d7188df): the shrink let its dependent
launch before its own wait, and the GEMM pulled the first 4-16 K steps of its W into L2, then waited for
the shrink before reading x, so that W streamed while the shrink ran, as the base GEMM is resident while
the kernel before it runs. Same bits (GPU tests). --matrix: 15.8-15.9 vs 15.4 µs of LoRA cost a layer (bf16
B), 23.4 vs 23.2 (fp32); end to end much slower (8-adapter step 6.15 vs 5.56 ms fp32, 6.00 vs 5.28 bf16;
not profiled: the early GEMM programs hold SMs while the kernels before the shrink still run). Removed.

What the epilogue costs, measured (session 13, Nsight Compute: ``benchmarks/gpu/profile_epilogue.py``, run
by ``run_device.sh ncu``; warp-state samples per SASS instruction, qkv with bf16 B on a ready buffer):
the K loop takes the same samples with and without LoRA (1027 vs 1044); after it the plain GEMM has 21
and the LoRA'd one had 173, over ~640 instructions a warp with one warp per scheduler (nothing hides
their latency), the largest stalls being the shared-memory store of B waiting for B's load and then
s's loads, issued only after that store (two round trips). ``block_delta`` now gathers s straight into
its slot's columns and loads it before B (one round trip; ``expand_block.slot_columns``): 126 samples,
~370 instructions, 128 registers with fp32 B instead of 157-166 (bf16 B: 128-134); --matrix 14.1-14.2
vs 15.4-16.5 µs of LoRA cost a layer with bf16 B and 22.8-23.3 vs 23.2-24.8 with fp32 (within gate_up's
spread between calls); the 8-adapter step 1.09x the base with bf16 LoRA weights (BENCHMARKS.md
session 13). What is left after the loop is that round trip (~40 samples)
and the MMA's wait (~15). Session 14: fp16 B (auto's storage for bf16 models, tf32 products) costs 16.4
µs a layer, the 8-adapter step 1.095-1.099x (BENCHMARKS.md).

Layout: the product is computed transposed, acc (BLOCK_N, BLOCK_M) = W_tile @ x_tile^T, so the long
axis (N) is the MMA's M and the few tokens its N (>= 16, padded by masking). A program owns a block of
columns; with ``split_k`` > 1 several programs share one over slices of K, and the last to finish
sums their partials in a fixed order and runs the epilogue (deterministic): small layers (o_proj,
qkv) have too few column blocks to keep every SM streaming W otherwise.

Numerics (the same as the unfused path, cuBLAS GEMM then the expand kernel): fp32 accumulation, bias
added in fp32, the base output rounded to y's dtype, then the delta (fp32: s rounded to the products'
dtype, ``precision.compute_dtype``: tf32 for fp32 B, and for fp16 B, with bf16 activations, as ``lora_expand``) added and rounded once more. This
is PEFT's order, ``result = base(x); result = result + lora_B(lora_A(x)) * s`` with the fp32 sum rounded.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.expand_block import block_delta, lora_slice, slots_per_chunk
from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    dot_in,
    interpreted,
    pdl_chain,
    persistent_buffer,
    prefetch_l2,
    tl_dtype,
    use_pdl,
)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{name}={value!r}: give a number of K steps (0 turns it off), or unset it for the default")
    return int(value)


# Knob (a module attribute: bench_decode_linear.py --matrix sweeps it; LORASERVE_PREFETCH_B_AHEAD=n sets it; None:
# by B's dtype, ``prefetch_ahead``): n K steps before the end of its K loop, each LoRA'd program pulls its
# epilogue's B into L2 (0: never). The epilogue on a ready buffer costs 1.6-5.8 µs an op (H200, session
# 10, bf16 B) where B's bytes take 0.3-1.7: mostly its load's latency after the loop. Timed (session 10,
# --matrix, LoRA cost per layer): bf16 B 17.5 vs 17.9 µs at 4 steps; fp32 B 27.6 at 4 and 27.3 at 2 vs
# 24.9 (its B is twice the lines), so it is on for half-precision B only. Session 8 pulled B before the K
# loop (commit cf605f9), slower.
PREFETCH_B_AHEAD: int | None = _env_int("LORASERVE_PREFETCH_B_AHEAD")


def prefetch_ahead(b_dtype: torch.dtype) -> int:
    """The K steps before the loop's end at which B of this dtype is pulled into L2 (PREFETCH_B_AHEAD)."""
    if PREFETCH_B_AHEAD is not None:
        return PREFETCH_B_AHEAD
    return 0 if b_dtype == torch.float32 else 4


MAX_TOKENS = 32  # the largest batch this kernel serves (a decode step's tokens; tuned there); beyond it, cuBLAS
# Knob (a module attribute; LORASERVE_DECODE_ONE_WAVE=0 turns it off): a product whose 64-row blocks would take more
# programs than the GPU has SMs (``sm_count``; one program an SM: their 120 KB of shared memory), but whose 128-row
# blocks fit, runs in one wave of 128-row blocks. Why: a PDL dependent launches once every program of its predecessor has started, so
# behind a two-wave GEMM (Qwen2.5-0.5B's gate/up: 152 blocks) the SiLU-and-mul starts only 2.7 µs before the GEMM
# ends (session 26). Measured (session 27, H100, Qwen2.5-0.5B, 32 tokens, CUDA graphs, with qkv's delta in the
# rotary launch and the norms on twice the warps): faster for the base step and the 8-adapter step alike, graph
# replay base 1.05 -> 1.01 ms and 8 adapters 1.26 -> 1.24 (step_trace 1.004 -> 0.969 and 1.217 -> 1.198): on by default
ONE_WAVE = os.environ.get("LORASERVE_DECODE_ONE_WAVE", "1") != "0"
# A module attribute (LORASERVE_DECODE_W_PREFETCH=0 turns it off): a GEMM that is an ordinary link of the PDL
# chain (it waits for the kernel before it before its K loop) first asks L2 for its rows of W over its K range, a
# prefetch per 128-byte line (weights: nothing in the chain writes them), so that after the wait its K loop meets
# L2's latency, not DRAM's. Why: a link launches while the kernel before it runs (a norm, the attention, the
# SiLU-and-mul: a few µs), and its programs sit idle until that kernel ends. Measured (session 28, H100, Qwen2.5-0.5B,
# 32 tokens, 8 adapters, CUDA graphs, step_trace): 8 adapters 1.195 -> 1.172 ms, base 0.967 -> 0.979 (alone); with
# the norms' weight before their wait (triton_elementwise.NORM_WEIGHT_EARLY) both faster, 0.961 and 1.140 (the
# defaults then: 0.966 and 1.209): on by default since. Llama-8B's GEMMs pass the size cap below: unchanged
W_PREFETCH = os.environ.get("LORASERVE_DECODE_W_PREFETCH", "1") != "0"
# ... for a W of at most this many bytes: the resident programs pull all of their rows at once, which must fit in L2
# beside what the step's other kernels keep there (the H100's and H200's L2: 50 MB; Qwen2.5-0.5B's gate/up 17 MB,
# Llama-8B's qkv 50 MB)
W_PREFETCH_MAX_BYTES = 24 << 20
ONE_WAVE_SMS = 132  # where no CUDA device answers (the interpreter): the H100 SXM's and H200's SMs


def w_prefetch_lines(weight: torch.Tensor, shrink_rows: int, k_per_split: int) -> int:
    """The 128-byte lines along K of each of its rows that a decode GEMM, a waiting link of the PDL chain, pulls
    into L2 before its wait (``W_PREFETCH``): 0 where it is off, where W and the shrink's rows of A pass
    W_PREFETCH_MAX_BYTES, or under the interpreter (the prefetch is inline PTX); at most 32 (4 KB a row of bf16)."""
    nbytes = (weight.shape[0] + shrink_rows) * weight.shape[1] * weight.element_size()
    if not W_PREFETCH or nbytes > W_PREFETCH_MAX_BYTES or interpreted():
        return 0
    return min(32, triton.next_power_of_2(triton.cdiv(k_per_split * weight.element_size(), 128)))


@functools.cache
def sm_count() -> int:
    """The current CUDA device's SMs (an H100 PCIe has 114, the SXM 132), else ONE_WAVE_SMS."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return ONE_WAVE_SMS


@dataclass(frozen=True)
class DecodeTiles:
    """One launch configuration. ``block_n`` must divide every LoRA slice's width (tiles never straddle
    two slices); ``block_k`` need not divide K (the last K block is masked)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # > 1: K is split over programs (serial reduction): more programs for small N


@dataclass
class ExpandEpilogue:
    """What the epilogue needs: the shrink's partials and the slots' B.

    buf: (SPLIT_K, n_slices, M, R) fp32 from ``lora_shrink``: every column written for the tokens with a
    slot (zeros past its rank); rows of base tokens may hold anything (never used). lora_b: per slice
    (S, 1, N_i, R), contiguous. token_slots: (M,) int on the device, -1 = base.
    """

    buf: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    token_slots: torch.Tensor
    pdl: bool = False  # the GEMM was launched as a PDL dependent of the shrink: wait before reading buf


# NOTE: a register cap on the LoRA variant (the maxnreg launch option, 168) was timed on the H200 (session
# 9, 8 fp32 slots): 25.4 vs 25.0 µs of LoRA cost per layer, and removed. It was suggested by a compile
# without the launch's specialization (255 registers and spills); compiled as launched the variant takes
# 157-166 registers without spills (session 9; 128-134 since session 13's epilogue), and shared memory,
# not registers, bounds its programs per SM (benchmarks/gpu/kernel_resources.py).


def default_tiles(M: int, N: int, K: int, dtype: torch.dtype, slices: tuple[int, ...] | None = None) -> DecodeTiles:
    """The tiles for a (M, K) x (N, K)^T product at M <= 32 tokens; ``slices``: the widths of its LoRA slices,
    where the GEMM adds their delta (the one-wave tiles only where they divide every slice).

    From the sweep of ``benchmarks/gpu/bench_decode_linear.py --tune`` on the H200 (Llama-8B shapes, 32
    tokens, bf16, 2026-12-03; µs, ours vs cuBLAS): 64-row blocks of W, 128-wide K steps, 5 stages on 4
    warps for qkv (16.6 vs 17.4); the same split over K in 2 for o (13.0 vs 14.9) and down (32.4 vs
    34.1), whose 64 column blocks alone leave half the 132 SMs idle; 4 stages for gate_up (59.3 vs
    58.5); 128-row blocks on 8 warps for lm_head (243 vs 257). Hence: split K until there are about
    128 programs (at most 4 ways, each split at least two K steps).
    """
    if N > 65536:
        return DecodeTiles(block_n=128, block_k=128, num_warps=8, num_stages=4)
    if N > 16384:
        return DecodeTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
    blocks = triton.cdiv(N, 64)
    if ONE_WAVE and blocks > sm_count() >= triton.cdiv(N, 128) and not any(n % 128 for n in slices or ()):
        return DecodeTiles(block_n=128, block_k=128, num_warps=8, num_stages=4)  # lm_head's tiles (see ONE_WAVE)
    split = max(1, min(4, 128 // blocks, K // 256))
    return DecodeTiles(block_n=64, block_k=128, num_warps=4, num_stages=5, split_k=split)


@functools.cache
def enabled() -> bool:
    """Whether the engine takes this kernel at all (on by default; LORASERVE_DECODE_LINEAR=0 turns it off).

    NOTE: off during session 4: the engine's bf16 logprobs had drifted from HF + PEFT in a device call
    that ran it with other new paths at once. Session 5's bisect (benchmarks/gpu/parity_bisect.sh)
    measured 0.0087 max |Δ logprob| with and without it, eager and graphs, the same as every other
    configuration. Between the two runs the unrolled split-plane loads were reverted and a race was
    fixed (the fused GEMM was a PDL dependent even when the shrink had launched nothing, and then read
    x unsynchronized); which of them the drift came from was not isolated.
    """
    return os.environ.get("LORASERVE_DECODE_LINEAR", "1") != "0"


def prefer_over_cublas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a base layer (no LoRA) should take ``decode_linear`` instead of cuBLAS: where the sweep
    measured it faster (see ``default_tiles``: N <= 16384 and the vocabulary-sized lm_head); in
    between (gate_up at 28672) cuBLAS was as fast or faster."""
    N = weight.shape[0]
    return enabled() and (N <= 16384 or N > 65536) and supports(x, weight)


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
        # across the loop) they cost gate_up 21.4 instead of 12.8 µs of LoRA (session 6, H200, 8 slots)
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
    line (``W_PREFETCH``); addresses clamped to the rows and the K range (no prefetch past them)."""
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
            x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k + tl.where(k >= x_k_base, x_shift, 0) + offs_k)[None, :]
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
def _decode_linear_kernel(
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
    tl.static_assert((W_PF_LINES == 0 and not TRIGGER_AFTER_WAIT) or WAIT_FIRST,
                     "W's prefetch and the trigger after the wait are for a link that waits before its K loop")
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
                total += tl.load(ws_ptr + sp * plane + pid_n * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
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


def _block_m(M: int) -> int:
    return 16 if M <= 16 else 32


def supports(x: torch.Tensor, weight: torch.Tensor, slices: tuple[int, ...] | None = None,
             tiles: DecodeTiles | None = None) -> bool:  # fmt: skip
    """Whether ``decode_linear`` takes this product (else the caller uses cuBLAS + shrink/expand)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] == 0 or x.shape[0] > MAX_TOKENS:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1 or x.device != weight.device:
        return False
    N, K = weight.shape
    if x.shape[1] != K or K % 16 != 0:
        return False
    if slices is not None:
        t = tiles or default_tiles(x.shape[0], N, K, x.dtype, slices)
        if len(slices) > 3 or sum(slices) != N or any(n % t.block_n for n in slices):
            return False
    return True


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: ExpandEpilogue | None = None,
    tiles: DecodeTiles | None = None,
    after_shrink: bool = False,
    shrink_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    trigger_after_wait: bool = False,
    in_k: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ weight (N, K)^T (+ bias) (+ the LoRA delta of ``lora``), in x's dtype.

    M <= MAX_TOKENS (a decode step); x and weight bf16/fp16, contiguous along K (``supports`` says which).
    ``after_shrink`` (no ``lora``): launched as the PDL dependent of a ``lora_shrink`` of x whose output
    the next kernel reads (``gated_lora``): x is read at once (the shrink waited for it) and each program
    waits for the shrink before it ends.
    ``shrink_into`` (a, s) (no ``lora``, not ``after_shrink``): the same launch also writes s (M, NA) fp32 =
    x a^T unrounded, a (NA, K) in W's dtype and row stride (a LoRA layer's ``gemm_shrink_rows``: every slot's A, in
    pieces that sum to it), NA a multiple of the tiles' block_n: NA / block_n more column blocks, each the
    same K loop as W's (products in W's dtype, fp32 sums), beside W's.
    ``trigger_after_wait`` (an ordinary link of the PDL chain: no ``lora``, not ``after_shrink``): each program
    lets the next launch start only after its wait for the kernel before it, so that the next launch, before
    its own wait, may read what that kernel wrote (the norm's shrink of x: ``gated_lora``'s ``s_ready``, the
    rotary launch's qkv delta, ``rotary_kv_cache(delta=...)``).
    ``in_k`` (k_base, shift_row, shift) (a plain GEMM: ``delta_in_k``): x has ``shift`` more columns than W, and
    W's rows from shift_row on read x's columns from k_base on ``shift`` further on (a second slice's set of
    columns past the base K); k_base a multiple of the tiles' K step, shift_row of their column block.
    """
    M = x.shape[0]
    N, K = weight.shape
    x_k_base, x_shift_row, x_shift = in_k if in_k is not None else (K, N, 0)
    assert x.shape[1] == K + x_shift, f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
    assert 0 < M <= MAX_TOKENS, f"decode_linear serves 1 to {MAX_TOKENS} tokens, got {M}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight must be contiguous along K"
    assert bias is None or (bias.shape == (N,) and bias.stride(0) == 1)
    sizes = tuple(b.shape[2] for b in lora.lora_b) if lora is not None else None
    tiles = tiles or default_tiles(M, N, K, x.dtype, sizes)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cdt = compute_dtype_of(x.dtype, weight.dtype)
    lora_args: tuple = (x, x, x, x, x, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    lora_consts = dict(
        R=16, NUM_SLICES=1, BLOCK_R=16, SLOTS_PER_CHUNK=1, RED=1, LORA_CDT=tl.float32, LORA_IEEE=False
    )
    assert not (after_shrink and lora is not None), "after_shrink is for a GEMM without the epilogue"
    pdl = after_shrink and use_pdl(x.device)
    assert not (trigger_after_wait and (after_shrink or lora is not None)), (
        "trigger_after_wait is for an ordinary link of the PDL chain (no epilogue, not after_shrink)"
    )
    pf = dict(PF_AHEAD=0, PF_SLOTS=1, PF_LINES=1)
    if lora is not None:
        b0 = lora.lora_b[0]
        n_sl = len(lora.lora_b)
        split, n_buf, m_buf, R = lora.buf.shape
        assert 1 <= n_sl <= 3 and n_buf == n_sl and m_buf == M, f"buf {tuple(lora.buf.shape)} does not fit"
        assert lora.buf.dtype == torch.float32 and lora.buf.stride(3) == 1
        assert sum(sizes) == N and all(n % tiles.block_n == 0 for n in sizes), (
            f"slices {sizes} must sum to N={N} and be multiples of block_n={tiles.block_n}"
        )
        for b in lora.lora_b:
            assert b.dtype == b0.dtype and b.shape[0] == b0.shape[0] and b.shape[3] == R
            assert b.stride()[1:] == (b.shape[2] * R, R, 1), "B must be contiguous (out, R) per slot"
        assert lora.token_slots.shape == (M,)
        b1 = lora.lora_b[1] if n_sl > 1 else b0
        b2 = lora.lora_b[2] if n_sl > 2 else b0
        lcdt = compute_dtype_of(x.dtype, b0.dtype)
        lora_args = (
            lora.buf, b0, b1, b2, lora.token_slots, b0.shape[0], split,
            sizes[0], sizes[1] if n_sl > 1 else 0,
            lora.buf.stride(0), lora.buf.stride(1), lora.buf.stride(2),
            b0.stride(0), b1.stride(0), b2.stride(0),
        )  # fmt: skip
        block_r = max(16, triton.next_power_of_2(R))
        per_chunk = slots_per_chunk(b0.shape[0], block_r)
        lora_consts = dict(
            R=R, NUM_SLICES=n_sl, BLOCK_R=block_r, SLOTS_PER_CHUNK=per_chunk, RED=min(triton.next_power_of_2(split), 16),
            LORA_CDT=tl_dtype(lcdt), LORA_IEEE=lcdt == torch.float32 and x.dtype == torch.float32,
        )  # fmt: skip
        pdl = lora.pdl
        ahead = prefetch_ahead(b0.dtype)
        # (the GPU only: the interpreter runs no inline PTX). NOTE: under split-K every split pulls the same
        # B (any of them may be the last to arrive and run the epilogue); the timings include that
        if ahead and x.device.type == "cuda" and not interpreted():
            pf = dict(PF_AHEAD=ahead, PF_SLOTS=triton.next_power_of_2(b0.shape[0]),
                      PF_LINES=triton.next_power_of_2(max(1, tiles.block_n * R * b0.element_size() // 128)))  # fmt: skip
    n_w_blocks = triton.cdiv(N, tiles.block_n)
    if in_k is not None:
        assert lora is None and shrink_into is None and not after_shrink, "in_k is for a plain GEMM"
        assert x_k_base % tiles.block_k == 0 and x_shift_row % tiles.block_n == 0 and x_k_base <= K, (
            f"in_k {in_k}: k_base a multiple of block_k={tiles.block_k}, shift_row of block_n={tiles.block_n}"
        )
    if shrink_into is not None:
        a, s = shrink_into
        NA = a.shape[0]
        assert lora is None and not after_shrink, "shrink_into is for a plain GEMM (its delta is added later)"
        assert a.shape == (NA, K) and a.dtype == weight.dtype and a.stride() == weight.stride(), (
            f"A's rows {tuple(a.shape)} {a.dtype} must be (NA, K={K}) in W's dtype {weight.dtype} and row stride"
        )
        assert NA % tiles.block_n == 0, f"the shrink's {NA} columns must be a multiple of block_n={tiles.block_n}"
        assert s.shape == (M, NA) and s.dtype == torch.float32 and s.stride(1) == 1, f"s {tuple(s.shape)} {s.dtype}"
        shrink_args = (a, s, n_w_blocks, NA, s.stride(0))
    else:
        shrink_args = (x, x, n_w_blocks, 0, 0)
    chain = pdl_chain(x.device)
    block_m = _block_m(M)
    n_blocks = n_w_blocks + shrink_args[3] // tiles.block_n
    split = tiles.split_k
    k_per_split = triton.cdiv(triton.cdiv(K, split), tiles.block_k) * tiles.block_k
    w_per_line = 128 // weight.element_size()
    w_pf_lines = w_prefetch_lines(weight, shrink_args[3], k_per_split) if chain and not pdl else 0
    ws, cnt = (x, x)
    if split > 1:
        ws = persistent_buffer(x.device, "decode_linear/partials", split * n_blocks * tiles.block_n * block_m, torch.float32)
        cnt = persistent_buffer(x.device, "decode_linear/arrivals", n_blocks)
    _decode_linear_kernel[(n_blocks * split,)](
        x, weight, bias if bias is not None else x, y, ws, cnt, M, N, K, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0),
        *shrink_args,
        *lora_args,
        HAS_BIAS=bias is not None, HAS_LORA=lora is not None, HAS_SHRINK=shrink_into is not None,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_W=split,
        EVEN_K=K % tiles.block_k == 0, EVEN_N=N % tiles.block_n == 0,
        CDT=tl_dtype(cdt), IEEE=cdt == torch.float32,
        # NOTE: as the shrink's dependent (USE_PDL) we may read x at once: the shrink waited for it before
        # letting us launch, and the epilogue waits for the shrink's buf; else we wait first
        USE_PDL=pdl, PDL_CHAIN=chain, WAIT_FIRST=chain and not pdl,
        TRIGGER_AFTER_WAIT=chain and not pdl and trigger_after_wait, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        launch_pdl=pdl or chain, W_PF_LINES=w_pf_lines, W_PER_LINE=w_per_line,
        x_k_base=x_k_base, x_shift_row=x_shift_row, x_shift=x_shift, X_SHIFT=in_k is not None,
        **pf,
        **lora_consts,
    )  # fmt: skip
    return y
