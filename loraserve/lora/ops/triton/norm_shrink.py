"""RMSNorm (with the residual add before it, or without) and the LoRA shrink of the projection it feeds,
in one launch: what a decode step's input and post-attention norms run when their output is x of a
LoRA'd qkv or gate/up projection.

    out, residual' = the norm's own numbers (``triton_elementwise``'s kernels, the same jit helper)
    buf[0, i, t, r] = sum_k A_i[slot(t), r, k] * out[t, k]      (fp32; zeros for r >= rank(slot(t)))
                    (``fold``, for rows up to FOLD_MAX_BLOCK: the same of the unrounded norm)

Why: on a small model's decode step every launch is latency, and the separate shrink sits between the
norm and the GEMM's epilogue, which waits for it. Here a program loads its tile of A (weights, and the
token's slot: the mapping, written before the forward) before its PDL wait, while the kernel before it
runs; after the wait it normalizes its row and dots it with that tile. The GEMM that follows is then an
ordinary link of the PDL chain (it waits for this launch, so for buf too) and no shrink launch is left.
Measured (H100, CUDA graphs, 32 tokens, 8 adapters): Qwen2.5-0.5B's step 1.387 -> 1.344 ms (base 1.005);
Llama-8B's 6.714 -> 6.705 ms.

Layout: program (t, j) owns token t and rank block j % NUM_RBLOCKS of slice j // NUM_RBLOCKS; each
program recomputes its row's norm (one row of x, and of the residual: a few KB), and only j == 0 stores
the norm's outputs. It runs on as many warps as the norm kernels (``num_warps``): the same layout of
the row, so the same order of the variance's fp32 sum and the same bits (compiled for sm_90, a 256-wide
row is laid out over 1 warp at the norm kernels' count and over 4 at 4 warps: another reduction order).
A tile of A, (BLOCK_R, next_pow2(K)), sits in registers: hidden sizes up to ``MAX_HIDDEN``.

Numbers: the products of a half-precision A and the rounded norm output are exact in fp32, and the sum
is fp32, as the shrink's tf32 MMA (exact products for half operands, fp32 sums) in another order. fp32 A
(whose products the shrink takes in tf32) is not taken here: ``supports`` says so, and the caller runs
the separate shrink. Every column r < R of a token with a slot is written (what decode_linear's epilogue
and ``gated_lora`` read: they load no rank); rows of base tokens are not.

The fold (``FOLD`` in the kernel; rows up to FOLD_MAX_BLOCK): s = rstd * sum_k (A[r, k] * w[k]) * x'[k] (x' the row
after the add, rstd its RMS scale: the norm's own numbers), every product and sum in fp32. The two sums after the
wait (the variance's and the shrink's) no longer run one after the other, and A * w is computed before it. The
shrink then skips the norm output's roundings (to x's dtype before the weight, to out's after): it is the exact
shrink of the unrounded norm to fp32 precision, where the unfolded form is the exact shrink of the rounded one; the
two differ by those roundings (2^-9 relative an element, a bf16 output), the size of the difference between PEFT's
bf16 and fp32 runs. Measured (H100, Qwen2.5-0.5B, 32 tokens, 8 adapters, CUDA graphs, step_trace): with gate/up's
delta as more K 1.129 -> 1.111 ms (base 0.96). Past FOLD_MAX_BLOCK the unfolded form runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.layers.triton_elementwise import norm_warps, rms_norm_row, rms_rstd
from loraserve.lora.ops.triton import row_delta
from loraserve.lora.ops.triton.row_delta import delta_b_tile, plus_delta
from loraserve.lora.ops.triton.utils import pdl_chain, slice_ptr, tl_dtype

MAX_HIDDEN = 4096  # a row of A's tile per rank in registers: past this the separate shrink runs
# Rows up to which the fold is taken: A's fp32 tile at 4096 takes 128 registers and spills (``kernel_resources.py --norm-shrink``)
FOLD_MAX_BLOCK = 2048
# Ranks a program owns. Compiled for sm_90 (bf16 x, fp16 A; ``kernel_resources.py --norm-shrink``): 92-161
# registers a thread at K = 896-4096, no spill
BLOCK_R = 16


@triton.jit
def _norm_shrink_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, a0_ptr, a1_ptr, a2_ptr, buf_ptr, slots_ptr, rank_ptr,
    stride_x, stride_r, stride_o, stride_ro, stride_as, stride_ar, stride_bi, stride_bm, N, R, eps,
    HAS_RESIDUAL: tl.constexpr, NUM_RBLOCKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL_CHAIN: tl.constexpr,
    # x's pending LoRA delta (row_delta: the row-parallel projection that wrote x left it to this launch)
    d_buf_ptr, d_b_ptr, d_slots_ptr, stride_dbs, stride_dsp, stride_dsm, stride_dss, D_P, D_R,
    HAS_DELTA: tl.constexpr,
    D_BLOCK_R: tl.constexpr, D_RED: tl.constexpr, D_CDT: tl.constexpr,
    # s into the output's columns past N instead of buf (``delta_in_k``): S slots a slice, in powers of two
    IN_K: tl.constexpr, S, S_POW2: tl.constexpr,
    FOLD: tl.constexpr,  # the shrink from the row before its normalization (the module's docstring)
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    sl = j // NUM_RBLOCKS
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    offs_r = (j % NUM_RBLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
    if PDL_CHAIN:  # a link of the step's PDL chain: the next kernel (the GEMM) may launch now
        tl.extra.cuda.gdc_launch_dependents()
    # before the wait: the mapping and the weights only (written before the forward)
    slot = tl.load(slots_ptr + row)
    rank = tl.load(rank_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    a_ptrs = slice_ptr(sl, a0_ptr, a1_ptr, a2_ptr) + tl.maximum(slot, 0).to(tl.int64) * stride_as
    a_ptrs = a_ptrs + offs_r[:, None] * stride_ar + offs[None, :]
    a = tl.load(a_ptrs, mask=(offs_r < rank)[:, None] & mask[None, :], other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if FOLD:  # A's tile times the norm's weight (fp32: exact products for a half-precision weight), while the kernel before runs
        a = a.to(tl.float32) * w.to(tl.float32)[None, :]
    if HAS_DELTA:  # every program of the row adds it (a few KB of B each: cheaper than a round trip between them)
        d_slot, bt = delta_b_tile(d_b_ptr, d_slots_ptr, row, stride_dbs, offs, mask, D_R, D_BLOCK_R)
    if PDL_CHAIN:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        x = plus_delta(x, bt, d_slot, d_buf_ptr, row, stride_dsp, stride_dsm, stride_dss, D_P, D_R, D_BLOCK_R, D_RED, D_CDT)
    if HAS_RESIDUAL:  # the fused add: torch's x + residual (fp32 add, one rounding)
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r_out_ptr.dtype.element_ty)
        if j == 0:
            tl.store(r_out_ptr + row * stride_ro + offs, x, mask=mask)
    if FOLD:  # the shrink's sum and the variance's, side by side: neither waits for the other
        xf = x.to(tl.float32)
        dot = tl.sum(a * xf[None, :], axis=1)
        rstd = rms_rstd(xf, N, eps)
        out = rms_norm_row(x, w, N, eps, rstd).to(out_ptr.dtype.element_ty)
        s = dot * rstd  # (BLOCK_R,): zeros past the rank
    else:
        out = rms_norm_row(x, w, N, eps).to(out_ptr.dtype.element_ty)
        s = tl.sum(a.to(tl.float32) * out.to(tl.float32)[None, :], axis=1)  # (BLOCK_R,): zeros past the rank
    if j == 0:
        tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if IN_K:  # every slot's columns of this slice and rank block: the token's s in its slot's, zeros elsewhere
        offs_s = tl.arange(0, S_POW2)
        cols = N + (sl * S + offs_s[:, None]) * R + offs_r[None, :]
        tile = tl.where(offs_s[:, None] == slot, s[None, :], 0.0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, tile, mask=(offs_s < S)[:, None] & (offs_r < R)[None, :])
    elif slot >= 0:
        tl.store(buf_ptr + sl * stride_bi + row * stride_bm + offs_r, s, mask=offs_r < R)


def supports(x: torch.Tensor, lora_a: tuple[torch.Tensor, ...]) -> bool:
    """Whether this launch can compute the shrink of x (T, K) with these A stacks (S, 1, R, K): half-precision
    A and x, K up to MAX_HIDDEN, 1-3 slices, A contiguous along K."""
    a0 = lora_a[0]
    return (
        1 <= len(lora_a) <= 3
        and x.dtype in (torch.float16, torch.bfloat16)
        and a0.dtype in (torch.float16, torch.bfloat16)
        and x.shape[-1] <= MAX_HIDDEN
        and a0.shape[3] == x.shape[-1]
        and all(a.shape == a0.shape and a.stride() == a0.stride() and a.dtype == a0.dtype and a.stride(3) == 1
                for a in lora_a)
    )


def norm_shrink(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    lora_a: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    delta=None,
    in_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(out, residual', buf): ``fused_add_rms_norm(x, residual, weight, eps)`` (``rms_norm`` when residual is
    None, residual' None), and buf (1, n_slices, T, R) fp32 = out @ A_i[slot]^T per token with a slot
    (``lora_shrink(..., zero_fill=True)``'s output: every column r < R written, zeros past the slot's rank;
    rows of base tokens unwritten; up to FOLD_MAX_BLOCK, out unrounded: see the module's docstring). x: (T, K); token_slots: (T,) int, -1 = base; ranks: int32 per slot.
    ``delta``: x's pending LoRA delta (a ``punica.PendingDelta``), added to x first (``row_delta``).

    ``in_k`` (``delta_in_k``): instead of buf, x_aug (T, K + n*S*R) in out's dtype, whose first K columns are out
    (out is their view) and column K + (i*S + j)*R + r holds the token's s_i[r] rounded where j is its slot,
    zeros elsewhere (base tokens: all zeros); (out, residual', x_aug)."""
    assert supports(x, lora_a), "norm_shrink: half-precision x and A, K <= MAX_HIDDEN (check supports())"
    T, K = x.shape
    assert weight.shape == (K,), f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
    assert token_slots.shape == (T,) and ranks.dtype == torch.int32, "token_slots (T,), ranks int32"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
    tl_dtype(x.dtype)
    a0 = lora_a[0]
    n, R = len(lora_a), a0.shape[2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    res = x if residual is None else (residual if residual.stride(-1) == 1 else residual.contiguous())
    S = a0.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    x_aug = torch.empty((T, K + n * S * R), dtype=out_dtype, device=x.device) if in_k else None
    out = x_aug[:, :K] if in_k else torch.empty((T, K), dtype=out_dtype, device=x.device)
    r_out = torch.empty((T, K), dtype=x.dtype, device=x.device) if residual is not None else out
    buf = out if in_k else torch.empty((1, n, T, R), dtype=torch.float32, device=x.device)  # (in_k: unused)
    if T:
        block = triton.next_power_of_2(K)
        n_rblocks = triton.cdiv(R, BLOCK_R)
        chain = pdl_chain(x.device)
        a1 = lora_a[1] if n > 1 else a0
        a2 = lora_a[2] if n > 2 else a0
        _norm_shrink_kernel[(T, n * n_rblocks)](
            x, res, weight, out, r_out, a0, a1, a2, buf, token_slots, ranks,
            x.stride(0), res.stride(0), out.stride(0), r_out.stride(0), a0.stride(0), a0.stride(2),
            0 if in_k else buf.stride(1), 0 if in_k else buf.stride(2), K, R, eps,
            HAS_RESIDUAL=residual is not None, NUM_RBLOCKS=n_rblocks, BLOCK=block, BLOCK_R=BLOCK_R,
            PDL_CHAIN=chain, num_warps=norm_warps(block), launch_pdl=chain,
            IN_K=in_k, S=S, S_POW2=triton.next_power_of_2(S), FOLD=block <= FOLD_MAX_BLOCK, **row_delta.kernel_args(delta, x),
        )  # fmt: skip
    return out, (r_out if residual is not None else None), (x_aug if in_k else buf)
