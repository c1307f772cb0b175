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

NOTE: measured and removed, because they were slower or no faster: this launch also computing down's shrink of its
output (holding every slot's tile of down's A doubled its time, more than the shrink launch it saved); gate/up's
GEMM letting this launch start only after its own wait so that the delta is computed before this launch's wait
(it starts too late in the GEMM's last wave for that to help); 128 columns a program (half the programs, to fit
beside a one-wave GEMM); and a register cap so that a program fits on an SM beside one of the GEMM's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.expand_block import expand_chunk, lora_b_chunk, slot_columns, slots_per_chunk
from loraserve.lora.ops.triton.utils import compute_dtype_of, pdl_chain, tl_dtype

MAX_TOKENS = 32  # one tile of tokens; a decode step's batch (decode_linear.MAX_TOKENS)
# Columns of each half a program owns, on NUM_WARPS warps: the fastest of ``bench_decode_linear.py --gated``
# (Qwen2.5-0.5B's gate_up, 32 tokens, 8 adapters: 3.1 µs of LoRA with bf16 B against 3.2 on 4 warps, 5.9 at 32
# columns, 4.1 at 128; fp32 B 4.6 against 5.3, 7.5 and 7.4)
BLOCK_N = 64
NUM_WARPS = 8


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
    PDL_CHAIN: tl.constexpr,  # a link of the step's PDL chain: B and the slots before the wait, y and buf after
):
    if PDL_CHAIN:
        tl.extra.cuda.gdc_launch_dependents()
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < D
    m_mask = offs_m < M
    slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int32)
    dg = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    du = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # num_stages=1, as block_delta's loop: pipelined, the loop would stage every chunk's s and B in shared
    # memory (which took decode_linear past the H200's limit); one chunk is the usual case
    for chunk in tl.range(0, S, SLOTS_PER_CHUNK, num_stages=1):
        # B before the wait: launched early, this kernel loads it while the GEMM still streams W
        bg = lora_b_chunk(bg_ptr, stride_wsg, n0, chunk, S, R, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK)
        bu = lora_b_chunk(bu_ptr, stride_wsu, n0, chunk, S, R, BLOCK_N, BLOCK_R, SLOTS_PER_CHUNK)
        if PDL_CHAIN:  # buf is the shrink's, which finished before the GEMM did (after_shrink)
            tl.extra.cuda.gdc_wait()
        sg = slot_columns(buf_ptr, stride_bm, stride_bsp, slot, m_mask, chunk, SPLIT_K, R, BLOCK_M, BLOCK_R, SLOTS_PER_CHUNK, RED)
        su = slot_columns(buf_ptr + stride_bi, stride_bm, stride_bsp, slot, m_mask, chunk, SPLIT_K, R, BLOCK_M, BLOCK_R,
                          SLOTS_PER_CHUNK, RED)  # fmt: skip
        dg = expand_chunk(dg, bg, sg, LORA_CDT, LORA_IEEE)
        du = expand_chunk(du, bu, su, LORA_CDT, LORA_IEEE)
    if PDL_CHAIN:  # y is the GEMM's (S >= 1 has waited: a met wait returns at once)
        tl.extra.cuda.gdc_wait()
    mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    out_dt = out_ptr.dtype.element_ty
    g = (tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32) + dg).to(out_dt).to(tl.float32)
    u = (tl.load(y_ptrs + D, mask=mask, other=0.0).to(tl.float32) + du).to(out_dt).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_dt).to(tl.float32)  # rounded, as silu_and_mul's is
    o = (silu * u).to(out_dt)
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], o, mask=mask)


# The largest K (the GEMM's inner size: the model's hidden_size) for which ``prefer`` takes this path over the
# delta in the GEMM's epilogue: the epilogue's latency weighs where each program's K loop is short. Measured on
# the H200 (bench_decode_linear.py --gated, 32 tokens, 8 adapters; LoRA cost of gate_up + SiLU-and-mul, this
# path against the epilogue, µs, bf16 B / fp32 B):
#   Qwen2.5-0.5B (2 x 4864 by K 896)     3.1 vs 4.7 / 4.7 vs 7.4
#   Qwen2.5-1.5B (2 x 8960 by K 1536)    5.8 vs 5.8 / 6.6 vs 8.3
#   Llama-3.2-1B (2 x 8192 by K 2048)    5.5 vs 5.3 / 8.1 vs 7.6
#   Llama-3.2-3B (2 x 8192 by K 3072)    6.0 vs 5.8 / 8.5 vs 8.1
#   Llama-3.1-8B (2 x 14336 by K 4096)   5.7 vs 4.6 / 8.4 vs 8.2
GATED_MAX_K = 1536


def prefer(N: int, K: int) -> bool:
    """Whether a gate_up of this (N, K) weight should add its delta in SiLU-and-mul (GATED_MAX_K)."""
    return K <= GATED_MAX_K


def silu_and_mul_lora(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, torch.Tensor],
    token_slots: torch.Tensor,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """(M, 2D) base gate/up output + the delta of (buf, lora_b) per token's slot -> silu(gate) * up (M, D).

    y: bf16/fp16/fp32, contiguous along its columns, M <= MAX_TOKENS. buf: (P, 2, M, R) fp32 from
    ``lora_shrink`` with ``zero_fill`` (P split-K planes, summed here). lora_b: gate's and up's
    (S, 1, D, R), contiguous, one dtype; D a multiple of block_n. token_slots: (M,) on the device, -1 = base. As a link of the
    PDL chain it must follow a kernel whose completion implies the shrink's (``decode_linear`` with
    ``after_shrink``, or any ordinary launch order). block_n, num_warps: BLOCK_N and NUM_WARPS (the
    benchmarks sweep them).
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
    _silu_and_mul_lora_kernel[(n_prog,)](
        y, out, M, D, y.stride(0), out.stride(0),
        buf, bg, bu, token_slots, S, P, buf.stride(0), buf.stride(1), buf.stride(2),
        bg.stride(0), bu.stride(0),
        R=R, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        SLOTS_PER_CHUNK=slots_per_chunk(S, block_r), RED=min(triton.next_power_of_2(P), 16),
        LORA_CDT=tl_dtype(lcdt), LORA_IEEE=lcdt == torch.float32 and y.dtype == torch.float32,
        PDL_CHAIN=chain, num_warps=num_warps, launch_pdl=chain,
    )  # fmt: skip
    return out
