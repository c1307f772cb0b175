"""A row-parallel projection's LoRA delta, added by the RMSNorm that reads the projection's output: what a
decode step's o_proj and down do on the GPU when their output goes straight into the residual add and
norm after them (Llama's decoder: o -> post-attention norm, down -> the next layer's input norm, or the
model's final norm).

    x'[t] = round(x[t] + sum_r B[slot(t), :, r] * s[t, r])        (x: the projection's base output)

then the norm's own numbers on x' (``fused_add_rms_norm``, or ``norm_shrink`` with the next projection's
shrink). s is the projection's shrink (fp32, its split planes summed in order here), rounded to the
products' dtype (``compute_dtype_of``: the reference's intermediate); the products and their sum over r
are fp32 (exact products for half-precision B; the reference's order of the sum over r differs, an fp32
rounding of the delta, far under the bf16 rounding of x' it is added to). PEFT's order: the base output
rounded, the delta added in fp32, one more rounding (``x + lora_B(lora_A(x)) * s``), then the residual add.

Why: at decode sizes on a small model every step is latency. With the delta in the GEMM's epilogue the
GEMM waits for its shrink after its K loop and pays the epilogue's round trips (loading s, then its MMA)
that nothing hides (1-2 µs an op on Qwen2.5-0.5B). Deferred, the GEMM runs as the shrink's dependent with
no epilogue (``decode_linear(after_shrink=True)``: it streams W while the shrink runs, as gate/up's GEMM
does for ``gated_lora``), and the norm, a link of the PDL chain launched while the GEMM runs, loads its
token's B (weights, and the slot: the mapping, written before the forward) before its wait; after it only
s's few floats are new. Measured (H100, Qwen2.5-0.5B shape, 32 tokens, 8 adapters, CUDA graphs): the
8-adapter step's graph replay 1.39 -> 1.32-1.34 ms (base 1.05); not taken by Llama-8B (hidden 4096 >
MAX_HIDDEN).

NOTE: two other orders of the launches were measured slower and removed: the GEMM first, letting its shrink
launch once x was complete (the shrink became the long pole), and the same for gate/up, its shrink beside its
GEMM instead of in the norm (that shrink took longer than the GEMM's remaining time).

The shrink in the GEMM: with no shrink handed on by the launch before (``shrunk``), the projection's GEMM
computes x A^T for every slot as column blocks past W's (``decode_linear(shrink_into=...)``, the layer's
``gemm_shrink_rows``: A's rows in W's dtype, ``precision.exact_pieces`` of it, two bf16 pieces for fp16 A) and
the norm sums the pieces' planes of its token's slot's columns: one launch fewer per projection. It shares W's
K loop and registers (``kernel_resources.py --gemm-shrink``: 64 and 80 registers for o and down). Measured (H100,
Qwen2.5-0.5B, 32 tokens, 8 adapters, CUDA graphs): graph replay 1.33 -> 1.31 ms (base 1.05). NOTE: a first form
ran a K loop of its own for those blocks, in tf32 on fp16 A: compiled for sm_90 the GEMM took 177 registers, and
the step was slower (replay 1.31 -> 1.48 ms); it was removed.

qkv's reader: where the input norm computed qkv's shrink (``norm_shrink``), qkv's GEMM runs without its epilogue
and lets the next launch start only after its own wait for that norm (``decode_linear(trigger_after_wait=True)``).
The attention's rotary + KV-cache launch (``rotary_kv_cache(delta=...)``, a program per head of a token) then reads
the norm's shrink and its head's columns of B and computes the delta before its own wait, while the GEMM still
streams W, and adds it to q, k and v after it (``punica.PendingQKVDelta``). Measured (H100, Qwen2.5-0.5B, 32
tokens, 8 adapters, CUDA graphs): step_trace 1.261 -> 1.214 ms after 8 decoded tokens and 1.285 -> 1.255 after
128. Taken up to ``QKV_MAX_HIDDEN`` (Llama-8B's qkv keeps its epilogue: not timed there). NOTE: the same reader
with the delta computed after the wait was not clearly faster, and was removed.

Layout: the norm's program owns one row (token); its B tile (BLOCK_R, BLOCK) sits in registers beside
the row, so hidden sizes up to ``MAX_HIDDEN``. NOTE: compiled for sm_90 at 4 warps for a row of 1024 the kernels
with the delta take 255 registers and spill 88-120 bytes a thread, at 8 warps 80 (fused_add_rms_norm) and 172
(norm_shrink) with no spill (``benchmarks/gpu/kernel_resources.py --norm-delta``). The warps set the order of the
variance's sum, so every norm kernel, with a delta or not, takes them from ``triton_elementwise.norm_warps``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import compute_dtype_of, sum_planes, tl_dtype

QKV_MAX_HIDDEN = 2048  # qkv's input size up to which it is taken (small models: Llama-8B's qkv keeps its epilogue, untimed)
MAX_HIDDEN = 2048  # the projection's output size (the norm's row): B's tile of a token lives in registers
MAX_RANK = 64


def supports(act_dtype: torch.dtype, lora_b: torch.Tensor, max_cols: int | None = MAX_HIDDEN) -> bool:
    """Whether a reader's launch can add the delta of this B stack (S, 1, N, R) to an output (T, N) of
    ``act_dtype``: half-precision activations and B, B contiguous per slot, R up to MAX_RANK, N up to ``max_cols``
    (a norm's row: MAX_HIDDEN; None, no limit: the rotary launch, whose programs take a head's columns each)."""
    S, one, N, R = lora_b.shape
    return (
        one == 1
        and (max_cols is None or N <= max_cols)
        and R <= MAX_RANK
        and act_dtype in (torch.float16, torch.bfloat16)
        and lora_b.dtype in (torch.float16, torch.bfloat16)
        and lora_b.stride()[1:] == (N * R, R, 1)
    )


def shrink_in_gemm(gemm_rows: torch.Tensor, weight: torch.Tensor, block_n: int) -> bool:
    """Whether the GEMM of ``weight`` (N, K) (column blocks of ``block_n``) also computes the shrink over these
    rows of A (P, S, R, K) (``BaseLinearLayerWithLoRA.gemm_shrink_rows``): W's dtype, contiguous with W's row
    stride, P * S * R a multiple of block_n and at most N (they cost what as many rows of W cost: every slot's,
    used or not). The columns past a slot's rank are computed too: the layers keep A's rows and B's columns
    there zero (``reset_lora``), so they add exactly zero."""
    P, S, R, K = gemm_rows.shape
    cols = P * S * R
    return (
        gemm_rows.dtype == weight.dtype
        and gemm_rows.is_contiguous()
        and weight.shape[1] == K
        and weight.stride() == (K, 1)
        and cols % block_n == 0
        and cols <= weight.shape[0]
    )


def kernel_args(delta, x: torch.Tensor) -> dict:
    """The keyword arguments of a norm kernel's delta operands (``delta_b_tile`` / ``plus_delta``) for
    ``delta`` (a ``punica.PendingDelta`` of x, or None: HAS_DELTA off, placeholders)."""
    if delta is None:
        return dict(d_buf_ptr=x, d_b_ptr=x, d_slots_ptr=x, stride_dbs=0, stride_dsp=0, stride_dsm=0, stride_dss=0,
                    D_P=1, D_R=1, HAS_DELTA=False, D_BLOCK_R=16, D_RED=1, D_CDT=tl.float32)  # fmt: skip
    buf, b = delta.buf, delta.lora_b
    P, one, T, C = buf.shape
    R = b.shape[3]
    cols = R if not delta.slot_cols else b.shape[0] * delta.slot_cols
    assert one == 1 and T == x.shape[0] and C == cols and buf.dtype == torch.float32 and buf.stride(3) == 1, (
        f"the pending delta's shrink {tuple(buf.shape)} {buf.dtype} does not fit x {tuple(x.shape)} and B "
        f"{tuple(b.shape)}: want (P, 1, T, {cols}) fp32"
    )
    assert not delta.slot_cols or delta.slot_cols >= R
    assert supports(x.dtype, b) and b.shape[2:] == (x.shape[1], R), (
        f"B {tuple(b.shape)} {b.dtype} does not fit x {tuple(x.shape)} {x.dtype} (supports())"
    )
    assert delta.token_slots.shape == (T,), f"token_slots {tuple(delta.token_slots.shape)} does not fit {T} tokens"
    return dict(
        d_buf_ptr=buf, d_b_ptr=b, d_slots_ptr=delta.token_slots, stride_dbs=b.stride(0), stride_dsp=buf.stride(0),
        stride_dsm=buf.stride(2), stride_dss=delta.slot_cols, D_P=P, D_R=R, HAS_DELTA=True, D_BLOCK_R=max(16, triton.next_power_of_2(R)),
        D_RED=min(triton.next_power_of_2(P), 16), D_CDT=tl_dtype(compute_dtype_of(x.dtype, b.dtype)),
    )  # fmt: skip


def qkv_kernel_args(delta, q: torch.Tensor, num_kv_heads: int) -> dict:
    """The keyword arguments of ``rotary_kv_cache``'s delta operands for ``delta`` (a ``punica.PendingQKVDelta``
    of the qkv projection whose output q (T, Hq, D) and its k and v (num_kv_heads heads each) are views of),
    or None (HAS_DELTA off, placeholders)."""
    if delta is None:
        return dict(d_buf_ptr=q, dbq_ptr=q, dbk_ptr=q, dbv_ptr=q, d_slots_ptr=q, stride_dbq=0, stride_dbk=0,
                    stride_dbv=0, stride_dsp=0, stride_dsi=0, stride_dsm=0, D_P=1, D_R=1, HAS_DELTA=False,
                    D_BLOCK_R=16, D_RED=1, D_CDT=tl.float32)  # fmt: skip
    T, Hq, D = q.shape
    bq, bk, bv = delta.lora_b
    buf = delta.buf
    P, n_sl, m_buf, R = buf.shape
    assert n_sl == 3 and m_buf == T and buf.dtype == torch.float32 and buf.stride(3) == 1, (
        f"the pending qkv delta's shrink {tuple(buf.shape)} {buf.dtype} does not fit q {tuple(q.shape)}: want (P, 3, {T}, R) fp32"
    )
    for b, n in ((bq, Hq * D), (bk, num_kv_heads * D), (bv, num_kv_heads * D)):
        assert supports(q.dtype, b, None) and b.shape[2:] == (n, R) and b.dtype == bq.dtype, (
            f"B {tuple(b.shape)} {b.dtype} does not fit {n} columns of q's dtype {q.dtype} and rank {R} (supports())"
        )
    assert delta.token_slots.shape == (T,), f"token_slots {tuple(delta.token_slots.shape)} does not fit {T} tokens"
    return dict(
        d_buf_ptr=buf, dbq_ptr=bq, dbk_ptr=bk, dbv_ptr=bv, d_slots_ptr=delta.token_slots, stride_dbq=bq.stride(0),
        stride_dbk=bk.stride(0), stride_dbv=bv.stride(0), stride_dsp=buf.stride(0), stride_dsi=buf.stride(1),
        stride_dsm=buf.stride(2), D_P=P, D_R=R, HAS_DELTA=True, D_BLOCK_R=max(16, triton.next_power_of_2(R)),
        D_RED=min(triton.next_power_of_2(P), 16), D_CDT=tl_dtype(compute_dtype_of(q.dtype, bq.dtype)),
    )  # fmt: skip


@triton.jit
def delta_b_tile(d_b_ptr, d_slots_ptr, row, stride_dbs, offs, mask, D_R, D_BLOCK_R: tl.constexpr):
    """(slot of the row, B[slot]^T as a (D_BLOCK_R, BLOCK) tile): zeros past R and for a base token (slot
    -1). Weights and the mapping: a PDL link loads them before its wait."""
    slot = tl.load(d_slots_ptr + row).to(tl.int32)
    offs_r = tl.arange(0, D_BLOCK_R)
    ptrs = d_b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_dbs + offs[None, :] * D_R + offs_r[:, None]
    b = tl.load(ptrs, mask=(offs_r < D_R)[:, None] & mask[None, :] & (slot >= 0), other=0.0)
    return slot, b


@triton.jit
def shrunk_row(slot, d_buf_ptr, row, stride_dsp, stride_dsm, stride_dss, D_P, D_R, D_BLOCK_R: tl.constexpr,
               D_RED: tl.constexpr, D_CDT: tl.constexpr):  # fmt: skip
    """s[row] (D_BLOCK_R,) fp32: the sum of the shrink's D_P planes (fp32, in plane order) rounded to the products'
    dtype D_CDT; stride_dss > 0: the row holds every slot's shrink, the token's at slot * stride_dss. Zeros for a
    base token, whose row the shrink leaves unwritten (never read)."""
    offs_r = tl.arange(0, D_BLOCK_R)
    s_mask = (offs_r < D_R) & (slot >= 0)
    s_row = d_buf_ptr + row * stride_dsm + tl.maximum(slot, 0) * stride_dss  # (stride_dss: every slot's columns)
    s = sum_planes(s_row + offs_r, s_mask, D_P, stride_dsp, D_RED, False)
    return s.to(D_CDT).to(tl.float32)


@triton.jit
def delta_of(bt, s):
    """B[slot] s at bt's columns (fp32): bt from ``delta_b_tile``, s from ``shrunk_row``."""
    return tl.sum(bt.to(tl.float32) * s[:, None], axis=0)


@triton.jit
def plus(x, d):
    """x + d rounded once to x's dtype (PEFT's order: the base output rounded, the LoRA delta added in fp32);
    x itself where d is None."""
    if d is not None:
        x = (x.to(tl.float32) + d).to(x.dtype)
    return x


@triton.jit
def plus_delta(x, bt, slot, d_buf_ptr, row, stride_dsp, stride_dsm, stride_dss, D_P, D_R, D_BLOCK_R: tl.constexpr,
               D_RED: tl.constexpr, D_CDT: tl.constexpr):  # fmt: skip
    """x (the row, its storage dtype) + B[slot] s[row], rounded once to x's dtype (PEFT's order: the base output
    rounded, the delta added in fp32). s from ``shrunk_row``; bt from ``delta_b_tile``. A base token adds zero."""
    s = shrunk_row(slot, d_buf_ptr, row, stride_dsp, stride_dsm, stride_dss, D_P, D_R, D_BLOCK_R, D_RED, D_CDT)
    return plus(x, delta_of(bt, s))
