"""SiLU-and-mul of a gate/up projection's base output, with the projection's LoRA delta added first, in
one launch: what a decode step's MLP runs after gate_up's GEMM on the GPU.

    out[t, j] = round(round(silu(g')) * u'),   g' = round(g[t, j] + dg[t, j]),  u' = round(u[t, j] + du[t, j])

where (g, u) are the base GEMM's output (rounded to its dtype), dg and du the delta of each token's
slot (``expand_block``: B_i[slot(t)] s_i[t] in fp32, s the shrink's output), and round() rounds to
the activations' dtype: exactly the numbers of the GEMM with the delta in its epilogue followed by
``silu_and_mul`` (PEFT's ``result + lora_B(lora_A(x)) * scaling``, one rounding, then the activation).

Why: in ``decode_linear`` the delta is an epilogue after each program's K loop, whose latency weighs
where that loop is short. SiLU-and-mul is a launch of its own anyway; with the delta in it, gate_up's
GEMM streams W without an epilogue and this kernel, a link of the PDL chain launched while the GEMM
runs, loads its B (weights, written before the forward) before it waits for the GEMM. Measured (``prefer``): faster
for small models (Qwen2.5-0.5B's gate_up, 32 tokens, 8 adapters: 3.1 instead of 4.7 µs of LoRA with
bf16 B, 4.7 instead of 7.4 with fp32 B; the 8-adapter step 1.15x the base instead of 1.26x), not for
Llama-8B's (5.7 vs 4.6 µs), so the engine takes it where K <= GATED_MAX_K.

Layout: program p owns columns [p * BLOCK_N, (p + 1) * BLOCK_N) of the gate half and the same columns of
the up half, for every token (up to BLOCK_M = 32): its two deltas are one MMA each per chunk of slots,
transposed as ``expand_block`` computes them (columns along the MMA's M).

Down's shrink (``down``; opt-in, ``LORASERVE_GATED_SHRINK=1``: measured slower, see SHRINK_ENABLED): the output is x of the
down projection, so this launch also computes down's LoRA shrink of it, as the norms do for qkv and gate/up
(``norm_shrink``): down's GEMM then runs without a shrink launch before it. Each program loads its columns
of every slot's A before its PDL wait (weights), multiplies its output tile by it (one MMA, exact tf32
products of half-precision values) and keeps each token's own slot's rows; the partials are summed in a
fixed order in two levels (``_shrink_of_output``), so the bits do not depend on which program finishes last.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.expand_block import expand_chunk, lora_b_chunk, slot_columns, slots_per_chunk
from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    dot_in,
    pdl_chain,
    persistent_buffer,
    power_of_two_env,
    register_cap_env,
    sum_planes,
    tl_dtype,
)

# The gated launch computes down's shrink of its output (``down``): opt-in, LORASERVE_GATED_SHRINK=1. Measured slower
# (session 21, H100, Qwen2.5-0.5B, 32 tokens, 8 adapters, with o's in attention: this kernel 5.8 -> 12.3 µs a layer, more
# than the 5.0 µs shrink launch it saves; the step 1.39 -> 1.76 ms): kept to build on, and its tests run it
SHRINK_ENABLED = os.environ.get("LORASERVE_GATED_SHRINK", "0") == "1"
# Where the norm before gate_up computed its shrink (``norm_shrink``), gate_up's GEMM lets this launch start only after
# its own wait for the norm, and the delta is computed before this launch's wait, off the chain's critical path
# (LORASERVE_GATED_EARLY_DELTA=1). Opt-in: measured no faster (session 26, H100, Qwen2.5-0.5B, 8 adapters: step_trace
# 1.262 -> 1.265 ms; this launch still ends 3.2 µs after the GEMM, the plain SiLU-and-mul 1.0). It starts only 2.7 µs
# before the GEMM ends, once the GEMM's second wave has started (152 column blocks, one an SM): likely too late for
# its loads before the wait, delta or not (BENCHMARKS.md, session 26)
EARLY_DELTA = os.environ.get("LORASERVE_GATED_EARLY_DELTA", "0") == "1"
MAX_TOKENS = 32  # one tile of tokens; a decode step's batch (decode_linear.MAX_TOKENS)
MAX_SHRINK_ROWS = 256  # rows of (slot, rank) of down's A tile a program holds (shrink_supports): 8 slots of rank 16 take 128
# Columns of each half a program owns (the --gated sweep's fastest; silu_and_mul_lora). LORASERVE_GATED_BLOCK_N=128:
# half the programs (Qwen2.5-0.5B: 38 instead of 76), so that with gate_up's GEMM in one wave on 76 SMs
# (triton_decode_linear.ONE_WAVE) every program can fit on an SM the GEMM leaves free and start before the GEMM ends.
# The reading it rests on, from registers (227 a thread at 64 columns: an SM a program) and session 27's trace (this
# launch ends 3.7-4.0 µs after the GEMM, the plain SiLU-and-mul 1.1), not measured directly: at 64 the 20 programs
# past the 56 free SMs start only as the GEMM's programs end. Measured no faster (session 28, H100, Qwen2.5-0.5B, 8
# adapters, step_trace): 8 adapters 1.195 -> 1.201 ms alone; 1.140 -> 1.143 with the norms' early weight and the W
# prefetch: opt-in
DEFAULT_BLOCK_N = power_of_two_env("LORASERVE_GATED_BLOCK_N", 64, 16, 256)
# A register cap a thread for this launch (a module attribute; LORASERVE_GATED_MAXNREG=192; opt-in, measured slower). Why:
# at 64 columns on 8 warps a program takes 227 registers a thread (58 K of the SM's 64 K), and a program of gate_up's
# one-wave GEMM leaves 48 K (and 67 KB of shared memory) beside it, so no program of this launch fits on an SM that
# holds one of the GEMM's: past the 56 SMs the GEMM leaves free, they start only as the GEMM ends. At 192 (16 bytes
# of spill) one fits beside each (``kernel_resources.py --beside``, compiled for sm_90 on the CPU). Measured (session
# 29, H100, Qwen2.5-0.5B, 8 adapters, step_trace): 1.142 -> 1.154 ms, with the early delta 1.146; bench_e2e's replay
# 1.19 -> 1.21 ms. Session 29's critical path (step_trace.py) shows why: this launch's part of the layer's critical
# path does not come from where its programs start; gate/up's delta costs about the same wherever it is computed
# (BENCHMARKS.md, session 29). The same numbers either way (its test)
MAX_REGISTERS = register_cap_env("LORASERVE_GATED_MAXNREG")


@triton.jit(do_not_specialize=["M", "S", "SPLIT_K"])
def _silu_and_mul_lora_kernel(
    y_ptr,  # (M, 2D): the base gate/up output
    out_ptr,  # (M, D)
    M,
    D,
    stride_ym,
    stride_om,
    buf_ptr,  # (SPLIT_K, 2, M, R) fp32: the shrink's output (gate's slice, up's slice)
    bg_ptr,  # (S, 1, D, R): gate's B
    bu_ptr,  # (S, 1, D, R): up's B
    slots_ptr,  # (M,) int: each token's slot, -1 = base
    S,
    SPLIT_K,
    stride_bsp,
    stride_bi,
    stride_bm,
    stride_wsg,
    stride_wsu,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOTS_PER_CHUNK: tl.constexpr,
    RED: tl.constexpr,
    LORA_CDT: tl.constexpr,
    LORA_IEEE: tl.constexpr,
    PDL_CHAIN: tl.constexpr,  # a link of the step's PDL chain: B and the slots before the wait, y and buf after (but S_READY)
    S_READY: tl.constexpr,  # (PDL_CHAIN) buf was complete before this launch started: the delta before the wait
    # down's shrink of the output (``SHRINK``): the next projection's A, its ranks, the (1, 1, M, RA) total
    # and the workspace of the partials (planes of every program, then of every group) and arrival counters
    da_ptr,  # (S, 1, RA, D): down's A
    drank_ptr,  # (S,) int32: down's rank per slot
    dbuf_ptr,  # (1, 1, M, RA) fp32
    ws_ptr,
    cnt_ptr,
    stride_das,
    GROUP,
    SHRINK: tl.constexpr,
    RA: tl.constexpr,
    BLOCK_RA: tl.constexpr,
    A_SLOTS_PER_CHUNK: tl.constexpr,
    RED_GROUP: tl.constexpr,
):
    if PDL_CHAIN:
        tl.extra.cuda.gdc_launch_dependents()
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < D
    m_mask = offs_m < M
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int32)
    if SHRINK:  # down's A for this block's columns, every slot: a weight, loaded before the wait
        da = _down_a_tile(da_ptr, drank_ptr, stride_das, n0, S, D, BLOCK_N, BLOCK_RA, A_SLOTS_PER_CHUNK)
    else:
        da = tl.zeros((A_SLOTS_PER_CHUNK * BLOCK_RA, BLOCK_N), dtype=tl.float32)
    dg = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    du = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # num_stages=1, as block_delta's loop: pipelined, the loop would stage every chunk's s and B in shared
    # memory (which took decode_linear past the H200's limit, session 13); one chunk is the usual case
    for chunk in tl.range(0, S, SLOTS_PER_CHUNK, num_stages=1):
        # B before the wait: launched early, this kernel loads it while the GEMM still streams W
        bg = lora_b_chunk(bg_ptr, stride_wsg, n0, chunk, S, R, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK)
        bu = lora_b_chunk(bu_ptr, stride_wsu, n0, chunk, S, R, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK)
        if PDL_CHAIN and not S_READY:  # buf is the shrink's, which finished before the GEMM did (after_shrink)
            tl.extra.cuda.gdc_wait()
        sg = slot_columns(buf_ptr, stride_bm, stride_bsp, slot, m_mask, chunk, SPLIT_K, R, BLOCK_M, BLOCK_R, SLOTS_PER_CHUNK, RED)
        su = slot_columns(buf_ptr + stride_bi, stride_bm, stride_bsp, slot, m_mask, chunk, SPLIT_K, R, BLOCK_M, BLOCK_R,
                          SLOTS_PER_CHUNK, RED)  # fmt: skip
        dg = expand_chunk(dg, bg, sg, LORA_CDT, LORA_IEEE)
        du = expand_chunk(du, bu, su, LORA_CDT, LORA_IEEE)
    if PDL_CHAIN:  # y is the GEMM's (S_READY: the first wait; else S >= 1 has waited, a met wait returns at once)
        tl.extra.cuda.gdc_wait()
    mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    out_dt = out_ptr.dtype.element_ty
    g = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + dg).to(out_dt).to(tl.float32)
    u = (tl.load(y_ptrs + D, mask=mask, other=0.0).to(tl.float32) + du).to(out_dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_dt).to(tl.float32)  # rounded, as silu_and_mul's is
    o = (silu * u).to(out_dt)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], o, mask=mask)
    if SHRINK:
        _shrink_of_output(o, da, slot, M, dbuf_ptr, ws_ptr, cnt_ptr, GROUP, RA, BLOCK_M, BLOCK_RA, A_SLOTS_PER_CHUNK,
                          RED_GROUP)  # fmt: skip


@triton.jit
def _down_a_tile(da_ptr, drank_ptr, stride_das, n0, S, D, BLOCK_N: tl.constexpr, BLOCK_RA: tl.constexpr,
                 A_SLOTS: tl.constexpr):  # fmt: skip
    """(A_SLOTS * BLOCK_RA, BLOCK_N) of down's A at columns n0..: row c is slot c // BLOCK_RA, rank c % BLOCK_RA;
    zeros past each slot's rank (whatever A holds there) and past S."""
    offs_c = tl.arange(0, A_SLOTS * BLOCK_RA)
    c_j = offs_c // BLOCK_RA
    c_r = offs_c % BLOCK_RA
    rank = tl.load(drank_ptr + c_j, mask=c_j < S, other=0)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ptrs = da_ptr + c_j[:, None].to(tl.int64) * stride_das + c_r[:, None] * D + offs_n[None, :]
    return tl.load(ptrs, mask=(c_r < rank)[:, None], other=0.0)


@triton.jit
def _shrink_of_output(o, da, slot, M, dbuf_ptr, ws_ptr, cnt_ptr, GROUP, RA: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_RA: tl.constexpr, A_SLOTS: tl.constexpr, RED_GROUP: tl.constexpr):  # fmt: skip
    """dbuf[0, 0, t, r] = sum over every program's columns n of A[slot(t), r, n] * o[n, t], deterministically.

    Each program's partial (its BLOCK_N columns; tf32 products of half-precision values, exact, summed in
    fp32 by one MMA) goes to its own plane of the workspace; the last program of each group of GROUP to
    arrive (an atomic counter) sums its group's planes in plane order into the group's plane, and the last
    group to finish sums the group planes in order into dbuf: the same bits whichever program arrives last.
    The pattern (stores, a CTA barrier, an acq_rel atomic, loads past L1) is lora_shrink's split-K one."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    p = dot_in(da, o, tl.float32, False)  # (A_SLOTS * BLOCK_RA, BLOCK_M): every slot's rows for every token
    p3 = tl.reshape(p, (A_SLOTS, BLOCK_RA, BLOCK_M))
    own = tl.arange(0, A_SLOTS)[:, None, None] == slot[None, None, :]
    part = tl.sum(tl.where(own, p3, 0.0), axis=0)  # (BLOCK_RA, BLOCK_M): each token's own slot's rows
    plane = BLOCK_RA * BLOCK_M
    tile = tl.arange(0, BLOCK_RA)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    full = tl.full((BLOCK_RA, BLOCK_M), 1, tl.int1)
    tl.store(ws_ptr + pid * plane + tile, part)
    tl.debug_barrier()
    n_groups = tl.cdiv(n_prog, GROUP)
    group = pid // GROUP
    first = group * GROUP
    arrived = tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.minimum(GROUP, n_prog - first) - 1:
        total = sum_planes(ws_ptr + first * plane + tile, full, tl.minimum(GROUP, n_prog - first), plane, RED_GROUP, True)
        tl.store(ws_ptr + (n_prog + group) * plane + tile, total)
        tl.atomic_xchg(cnt_ptr + group, 0, sem="relaxed", scope="gpu")
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + n_groups, 1, sem="acq_rel", scope="gpu")
        if done == n_groups - 1:
            total = sum_planes(ws_ptr + n_prog * plane + tile, full, n_groups, plane, RED_GROUP, True)
            offs_r = tl.arange(0, BLOCK_RA)
            offs_m = tl.arange(0, BLOCK_M)
            mask = (offs_r < RA)[:, None] & (offs_m < M)[None, :]
            tl.store(dbuf_ptr + offs_m[None, :] * RA + offs_r[:, None], total, mask=mask)
            tl.atomic_xchg(cnt_ptr + n_groups, 0, sem="relaxed", scope="gpu")


# Knob (a module attribute; LORASERVE_GATED_LORA=1/0 forces the path on/off): the largest K (the GEMM's inner
# size: the model's hidden_size) for which ``prefer`` takes this path over the delta in the GEMM's epilogue:
# the epilogue's latency weighs where each program's K loop is short. Measured on the H200 (session 11, before
# session 13 made both paths gather s into its slot's columns;
# bench_decode_linear.py --gated, 32 tokens, 8 adapters; LoRA cost of gate_up + SiLU-and-mul, this path
# against the epilogue, µs, bf16 B / fp32 B):
#   Qwen2.5-0.5B (2 x 4864 by K 896)     3.1 vs 4.7 / 4.7 vs 7.4
#   Qwen2.5-1.5B (2 x 8960 by K 1536)    5.8 vs 5.8 / 6.6 vs 8.3
#   Llama-3.2-1B (2 x 8192 by K 2048)    5.5 vs 5.3 / 8.1 vs 7.6
#   Llama-3.2-3B (2 x 8192 by K 3072)    6.0 vs 5.8 / 8.5 vs 8.1
#   Llama-3.1-8B (2 x 14336 by K 4096)   5.7 vs 4.6 / 8.4 vs 8.2
GATED_MAX_K = 1536


def prefer(N: int, K: int) -> bool:
    """Whether a gate_up of this (N, K) weight should add its delta in SiLU-and-mul (GATED_MAX_K)."""
    forced = os.environ.get("LORASERVE_GATED_LORA")
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"LORASERVE_GATED_LORA={forced!r}: give 1 (on), 0 (off), or unset it for the default")
        return forced == "1"
    return K <= GATED_MAX_K


def shrink_supports(lora_a: torch.Tensor, y: torch.Tensor, block_n: int = DEFAULT_BLOCK_N) -> bool:
    """Whether ``silu_and_mul_lora`` can compute the shrink of its output with this A stack (S, 1, RA, D) of
    the projection it feeds (``down``): every slot's tile of A in one MMA (at most MAX_SHRINK_ROWS rows of
    (slot, rank)), contiguous, of a dtype the shrink multiplies in tf32 (half precision, exact; or fp32, as
    the shrink launch takes it at decode sizes)."""
    S, one, RA, D = lora_a.shape
    rows = triton.next_power_of_2(S) * max(16, triton.next_power_of_2(RA))
    return (
        one == 1
        and 2 * D == y.shape[1]
        and lora_a.is_contiguous()
        and lora_a.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and rows <= MAX_SHRINK_ROWS
        and D % block_n == 0
    )


def silu_and_mul_lora(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, torch.Tensor],
    token_slots: torch.Tensor,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 8,
    down: tuple[torch.Tensor, torch.Tensor] | None = None,
    s_ready: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(M, 2D) base gate/up output + the delta of (buf, lora_b) per token's slot -> silu(gate) * up (M, D).

    y: bf16/fp16/fp32, contiguous along its columns, M <= MAX_TOKENS. buf: (P, 2, M, R) fp32 from
    ``lora_shrink`` with ``zero_fill`` (P split-K planes, summed here). lora_b: gate's and up's
    (S, 1, D, R), contiguous, one dtype; D a multiple of block_n. token_slots: (M,) on the device, -1 = base. As a link of the
    PDL chain it must follow a kernel whose completion implies the shrink's (``decode_linear`` with
    ``after_shrink``, or any ordinary launch order). block_n, num_warps: the fastest of the --gated
    sweep (64 columns, 8 warps: Qwen-0.5B's gate_up 3.1 µs of LoRA with bf16 B against 3.2 on 4 warps, 5.9
    at 32 columns, 4.1 at 128; fp32 B 4.6 against 5.3, 7.5 and 7.4).

    ``down``: (A (S, 1, RA, D), its ranks (S,) int32) of the projection the output feeds (``shrink_supports``):
    then (out, dbuf), dbuf (1, 1, M, RA) fp32 = out @ A[slot]^T per token, what ``lora_shrink(out, ...,
    zero_fill=True)`` gives (every column r < RA of every row written, zeros past the slot's rank and for
    base tokens), the down GEMM's ``shrunk``: its shrink launch is not needed.

    ``s_ready``: buf was complete before this launch could start (the norm wrote it, and the GEMM before this
    launch, ``decode_linear(trigger_after_wait=True)``, lets it launch only after waiting for the norm): the
    whole delta is computed before the PDL wait, and after it only y is read (``EARLY_DELTA``).
    """
    M, D2 = y.shape
    D = D2 // 2
    P, n_sl, m_buf, R = buf.shape
    bg, bu = lora_b
    assert D2 == 2 * D and 0 < M <= MAX_TOKENS, f"y {tuple(y.shape)}: (1..{MAX_TOKENS} tokens, 2D)"
    assert y.stride(1) == 1, "y must be contiguous along its columns"
    assert n_sl == 2 and m_buf == M and buf.dtype == torch.float32 and buf.stride(3) == 1, (
        f"buf {tuple(buf.shape)} {buf.dtype} does not fit y {tuple(y.shape)}: want (P, 2, {M}, R) fp32"
    )
    for b in lora_b:
        assert b.shape == (bg.shape[0], 1, D, R) and b.dtype == bg.dtype, (
            f"B {tuple(b.shape)} {b.dtype}: want ({bg.shape[0]}, 1, {D}, {R}) {bg.dtype}"
        )
        assert b.stride()[1:] == (D * R, R, 1), "B must be contiguous (out, R) per slot"
    assert token_slots.shape == (M,), f"token_slots {tuple(token_slots.shape)} does not fit {M} tokens"
    # B is read unmasked along its columns (lora_b_chunk): a partial block would read past D
    assert D % block_n == 0, f"D={D} (each half of y) must be a multiple of block_n={block_n}: give a smaller block_n"
    block_r = max(16, triton.next_power_of_2(R))
    lcdt = compute_dtype_of(y.dtype, bg.dtype)
    out = torch.empty(M, D, dtype=y.dtype, device=y.device)
    chain = pdl_chain(y.device)
    n_prog = triton.cdiv(D, block_n)
    S = bg.shape[0]
    block_m = 16 if M <= 16 else 32
    if down is not None:
        da, drank = down
        assert shrink_supports(da, y, block_n) and da.shape[0] == S, (
            f"down's A {tuple(da.shape)} {da.dtype}: want ({S}, 1, RA, {D}) contiguous, see shrink_supports"
        )
        assert drank.shape == (S,) and drank.dtype == torch.int32, "down's ranks: (S,) int32"
        ra = da.shape[2]
        block_ra = max(16, triton.next_power_of_2(ra))
        a_slots = triton.next_power_of_2(S)
        group = max(1, math.isqrt(n_prog - 1) + 1)  # ~sqrt(programs) planes summed at each of the two levels
        n_groups = triton.cdiv(n_prog, group)
        plane = block_ra * block_m
        ws = persistent_buffer(y.device, "gated_lora/partials", (n_prog + n_groups) * plane, torch.float32)
        cnt = persistent_buffer(y.device, "gated_lora/arrivals", n_groups + 1)
        dbuf = torch.empty((1, 1, M, ra), dtype=torch.float32, device=y.device)
        shrink_kw = dict(da_ptr=da, drank_ptr=drank, dbuf_ptr=dbuf, ws_ptr=ws, cnt_ptr=cnt, stride_das=da.stride(0),
                         GROUP=group, SHRINK=True, RA=ra, BLOCK_RA=block_ra, A_SLOTS_PER_CHUNK=a_slots,
                         RED_GROUP=min(triton.next_power_of_2(max(group, n_groups)), 16))  # fmt: skip
    else:
        shrink_kw = dict(da_ptr=out, drank_ptr=token_slots, dbuf_ptr=out, ws_ptr=out, cnt_ptr=token_slots,
                         stride_das=0, GROUP=1, SHRINK=False, RA=16, BLOCK_RA=16, A_SLOTS_PER_CHUNK=1, RED_GROUP=1)
    _silu_and_mul_lora_kernel[(n_prog,)](
        y, out, M, D, y.stride(0), out.stride(0),
        buf, bg, bu, token_slots, S, P, buf.stride(0), buf.stride(1), buf.stride(2),
        bg.stride(0), bu.stride(0),
        R=R, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        SLOTS_PER_CHUNK=slots_per_chunk(S, block_r), RED=min(triton.next_power_of_2(P), 16),
        LORA_CDT=tl_dtype(lcdt), LORA_IEEE=lcdt == torch.float32 and y.dtype == torch.float32,
        PDL_CHAIN=chain, S_READY=s_ready, num_warps=num_warps, launch_pdl=chain, **shrink_kw,
        **({"maxnreg": MAX_REGISTERS} if MAX_REGISTERS else {}),
    )  # fmt: skip
    return out if down is None else (out, dbuf)
