"""A projection's LoRA delta, added by the launch that reads the projection's output: what a decode step's
o_proj and down can do on the GPU when their output goes straight into the residual add and norm after them
(Llama's decoder: o -> post-attention norm, down -> the next layer's input norm, or the model's final norm),
and qkv_proj when its output goes to the attention's rotary + KV-cache launch (``rotary_kv_cache``: each
program adds its head's columns, q's or k's and v's). On by default (``LORASERVE_DEFER_DELTA=0`` turns it off:
the delta in the GEMM's epilogue; ``LORASERVE_DEFER_QKV=0`` only qkv's).

    x'[t] = round(x[t] + sum_r B[slot(t), :, r] * s[t, r])        (x: the projection's base output)

then the norm's own numbers on x' (``fused_add_rms_norm``, or ``norm_shrink`` with the next projection's
shrink). s is the projection's shrink (fp32, its split planes summed in order here), rounded to the
products' dtype (``compute_dtype_of``: the reference's intermediate); the products and their sum over r
are fp32 (exact products for half-precision B; the reference's order of the sum over r differs, an fp32
rounding of the delta, far under the bf16 rounding of x' it is added to). PEFT's order: the base output
rounded, the delta added in fp32, one more rounding (``x + lora_B(lora_A(x)) * s``), then the residual add.

Why: at decode sizes on a small model every step is latency. With the delta in the GEMM's epilogue the
GEMM waits for its shrink after its K loop and pays the epilogue's round trips (loading s, then its MMA)
that nothing hides (session 20's trace, Qwen2.5-0.5B: 1-2 µs an op). Deferred, the GEMM runs as the
shrink's dependent with no epilogue (``decode_linear(after_shrink=True)``: it streams W while the shrink
runs, as gate/up's GEMM does for ``gated_lora``), and the norm, a link of the PDL chain launched while
the GEMM runs, loads its token's B (weights, and the slot: the mapping, written before the forward)
before its wait; after it only s's few floats are new. Measured (session 22, H100, Qwen2.5-0.5B shape, 32
tokens, 8 adapters, CUDA graphs; BENCHMARKS.md): the 8-adapter step's graph replay 1.39 -> 1.32-1.34 ms
(base 1.05), step_trace 1.316x -> 1.294x the base; not taken by Llama-8B (hidden 4096 > MAX_HIDDEN).

NOTE: two orders of the launches were measured and removed (session 22, commit 21870b3): the GEMM first,
letting its shrink launch once x was complete and the shrink waiting for the GEMM only before ending
(the step 1.302 vs 1.300 ms: the shrink, 4.4 µs, became the long pole), and the same for gate/up, its
shrink beside its GEMM instead of in the norm (1.344 ms, slower: that shrink took 6 µs, longer than
the GEMM's remaining time; its decoder test also failed on the GPU, not investigated).

Layout: the norm's program owns one row (token); its B tile (BLOCK_R, BLOCK) sits in registers beside
the row, so hidden sizes up to ``MAX_HIDDEN``, on twice the plain norm's warps (``norm_warps``: at 4 warps a
1024-row's tile spilled). The rotary launch's program owns one head of one token: tiles of D columns.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import compute_dtype_of, sum_planes, tl_dtype

# The row-parallel projections before a norm leave their delta to it (measured faster on Qwen2.5-0.5B, session 22);
# LORASERVE_DEFER_DELTA=0: the delta in the GEMM's epilogue, as before
ENABLED = os.environ.get("LORASERVE_DEFER_DELTA", "1") != "0"
# qkv's delta left to the attention's rotary launch too (session 22, measured in run_device.sh qkv22);
# LORASERVE_DEFER_QKV=0: qkv's delta in its GEMM's epilogue
QKV = os.environ.get("LORASERVE_DEFER_QKV", "1") != "0"
MAX_HIDDEN = 2048  # the projection's output size (the norm's row): B's tile of a token lives in registers
MAX_RANK = 64


def supports(act_dtype: torch.dtype, lora_b: torch.Tensor, max_cols: int | None = MAX_HIDDEN) -> bool:
    """Whether a reader's launch can add the delta of this B stack (S, 1, N, R) to an output (T, N) of
    ``act_dtype``: half-precision activations and B, B contiguous per slot, R up to MAX_RANK, N up to ``max_cols``
    (a norm's row: MAX_HIDDEN; None: no limit, for a reader whose programs take a head's columns each)."""
    S, one, N, R = lora_b.shape
    return (
        one == 1
        and (max_cols is None or N <= max_cols)
        and R <= MAX_RANK
        and act_dtype in (torch.float16, torch.bfloat16)
        and lora_b.dtype in (torch.float16, torch.bfloat16)
        and lora_b.stride()[1:] == (N * R, R, 1)
    )


def kernel_args(delta, x: torch.Tensor) -> dict:
    """The keyword arguments of a norm kernel's delta operands (``delta_b_tile`` / ``shrunk_row`` /
    ``delta_of``) for ``delta`` (a one-slice ``punica.PendingDelta`` of x, or None: HAS_DELTA off, placeholders)."""
    if delta is None:
        return dict(d_buf_ptr=x, d_b_ptr=x, d_slots_ptr=x, stride_dbs=0, stride_dsp=0, stride_dsm=0, D_P=1, D_R=1,
                    HAS_DELTA=False, D_BLOCK_R=16, D_RED=1, D_CDT=tl.float32)  # fmt: skip
    (b,) = delta.lora_b
    buf = delta.buf
    P, one, T, R = buf.shape
    assert one == 1 and T == x.shape[0], (
        f"the pending delta's shrink {tuple(buf.shape)} does not fit x {tuple(x.shape)}: want (P, 1, T, R)"
    )
    assert supports(x.dtype, b) and b.shape[2:] == (x.shape[1], R), (
        f"B {tuple(b.shape)} {b.dtype} does not fit x {tuple(x.shape)} {x.dtype} (supports())"
    )
    return dict(d_buf_ptr=buf, d_b_ptr=b, d_slots_ptr=delta.token_slots, stride_dbs=b.stride(0), stride_dsp=buf.stride(0),
                stride_dsm=buf.stride(2), **shrunk_consts(delta, x))  # fmt: skip


def qkv_kernel_args(delta, q: torch.Tensor, num_kv_heads: int) -> dict:
    """The keyword arguments of ``rotary_kv_cache``'s delta operands for ``delta`` (a ``punica.PendingDelta``
    of the qkv projection whose output q (T, Hq, D) and its k and v (num_kv_heads each) are views of: its B
    as three slices (q, k, v) or one over all the columns), or None (HAS_DELTA off, placeholders)."""
    if delta is None:
        return dict(d_buf_ptr=q, dbq_ptr=q, dbk_ptr=q, dbv_ptr=q, d_slots_ptr=q, q_col=0, k_col=0, v_col=0,
                    stride_dbq=0, stride_dbk=0, stride_dbv=0, q_sl=0, k_sl=0, v_sl=0, stride_dsp=0, stride_dsi=0,
                    stride_dsm=0, D_P=1, D_R=1, HAS_DELTA=False, D_BLOCK_R=16, D_RED=1, D_CDT=tl.float32)  # fmt: skip
    T, Hq, D = q.shape
    nq, nk = Hq * D, num_kv_heads * D
    bs = delta.lora_b
    sizes = [b.shape[2] for b in bs]
    if sizes == [nq, nk, nk]:
        parts = [(bs[0], 0, 0), (bs[1], 0, 1), (bs[2], 0, 2)]
    else:
        assert sizes == [nq + 2 * nk], f"B's slices {sizes} are not q | k | v of {Hq} + 2 x {num_kv_heads} heads of {D}"
        parts = [(bs[0], 0, 0), (bs[0], nq, 0), (bs[0], nq + nk, 0)]
    R = delta.buf.shape[3]
    for b in bs:
        assert supports(q.dtype, b, None) and b.shape[3] == R and b.dtype == bs[0].dtype, (
            f"B {tuple(b.shape)} {b.dtype} does not fit q {q.dtype} (supports())"
        )
    buf = delta.buf
    (bq, q_col, q_sl), (bk, k_col, k_sl), (bv, v_col, v_sl) = parts
    return dict(
        d_buf_ptr=buf, dbq_ptr=bq, dbk_ptr=bk, dbv_ptr=bv, d_slots_ptr=delta.token_slots, q_col=q_col, k_col=k_col,
        v_col=v_col, stride_dbq=bq.stride(0), stride_dbk=bk.stride(0), stride_dbv=bv.stride(0), q_sl=q_sl, k_sl=k_sl,
        v_sl=v_sl, stride_dsp=buf.stride(0), stride_dsi=buf.stride(1), stride_dsm=buf.stride(2),
        **shrunk_consts(delta, q),
    )  # fmt: skip


def shrunk_consts(delta, x: torch.Tensor) -> dict:
    """The constants of ``shrunk_row`` for a ``punica.PendingDelta`` of x (checked: fp32 buf, its rows x's)."""
    buf = delta.buf
    P, _, T, R = buf.shape
    assert buf.dtype == torch.float32 and buf.stride(3) == 1, f"the shrink {tuple(buf.shape)} {buf.dtype}: fp32, R contiguous"
    assert delta.token_slots.shape == (T,) and T == x.shape[0], (
        f"token_slots {tuple(delta.token_slots.shape)} / the shrink's {T} rows do not fit x {tuple(x.shape)}"
    )
    return dict(D_P=P, D_R=R, HAS_DELTA=True, D_BLOCK_R=max(16, triton.next_power_of_2(R)),
                D_RED=min(triton.next_power_of_2(P), 16),
                D_CDT=tl_dtype(compute_dtype_of(x.dtype, delta.lora_b[0].dtype)))  # fmt: skip


@triton.jit
def delta_b_tile(d_b_ptr, d_slots_ptr, row, stride_dbs, offs, mask, D_R, D_BLOCK_R: tl.constexpr):
    """(slot of the row, B[slot]^T at columns ``offs`` as a (D_BLOCK_R, len(offs)) tile): zeros past R and for a
    base token (slot -1). Weights and the mapping: a PDL link loads them before its wait."""
    slot = tl.load(d_slots_ptr + row).to(tl.int32)
    offs_r = tl.arange(0, D_BLOCK_R)
    ptrs = d_b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_dbs + offs[None, :] * D_R + offs_r[:, None]
    b = tl.load(ptrs, mask=(offs_r < D_R)[:, None] & mask[None, :] & (slot >= 0), other=0.0)
    return slot, b


@triton.jit
def shrunk_row(slot, d_buf_ptr, row, stride_dsp, stride_dsm, D_P, D_R, D_BLOCK_R: tl.constexpr, D_RED: tl.constexpr,
               D_CDT: tl.constexpr):  # fmt: skip
    """s[row] (D_BLOCK_R,) fp32: the sum of the shrink's D_P planes (fp32, in plane order) rounded to the
    products' dtype D_CDT; zeros for a base token, whose row the shrink leaves unwritten (never read)."""
    offs_r = tl.arange(0, D_BLOCK_R)
    s_mask = (offs_r < D_R) & (slot >= 0)
    s = sum_planes(d_buf_ptr + row * stride_dsm + offs_r, s_mask, D_P, stride_dsp, D_RED, False)
    return s.to(D_CDT).to(tl.float32)


@triton.jit
def delta_of(bt, s):
    """B[slot] s at bt's columns (fp32): bt from ``delta_b_tile``, s from ``shrunk_row``."""
    return tl.sum(bt.to(tl.float32) * s[:, None], axis=0)
