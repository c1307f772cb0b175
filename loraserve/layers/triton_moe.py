"""The experts on the GPU: a Triton grouped GEMM over expert-aligned blocks (``moe_align``).

``fused_experts`` is ``FusedMoE.experts_forward`` without a Python loop over experts and without a
host sync (CUDA-graph capturable): align the T*k (token, expert) assignments by expert, one grouped
GEMM for w13 (rows read from x by token), the activation, one grouped GEMM for w2 (rows read by
assignment), then the top-k weighted sum. Outputs are per assignment, row t*k + j for the j-th expert
of token t, so the LoRA hook (``BatchedExpertHook``) can add its per-(slot, expert) deltas to them.

Imported only on CUDA (or under TRITON_INTERPRET=1 in tests): CPU installs have no triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl

from loraserve.layers.moe_align import AlignedBlocks, align_by_group, pick_block_m
from loraserve.lora.ops.triton.utils import tl_dtype


class BatchedExpertHook(Protocol):
    """Adds to the per-assignment expert outputs in place (the LoRA deltas), given the per-assignment
    inputs: ``x`` (T, H) read by token for w13, ``a`` (T*k, I) by assignment for w2."""

    def w13(self, h: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> None: ...

    def w2(self, y: torch.Tensor, a: torch.Tensor, ids: torch.Tensor) -> None: ...


# NOTE: sizes (K, N, column offsets) are specialized, not do_not_specialize: Triton then knows they are
# multiples of 16 and vectorizes the masked loads along the contiguous axis; as runtime ints every
# masked load there went scalar. Specializing compiles once per divisibility class, not per value.
@triton.jit(do_not_specialize=["n_valid"])
def _moe_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    block_group_ptr,
    n_valid,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    TOKEN_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """out[i, n] = x[i // TOKEN_DIV] . W[e, n] for the rows i of a block of expert e."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_group_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m).to(tl.int64)
    m_mask = rows < n_valid
    x_rows = rows // TOKEN_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_base = x_ptr + x_rows[:, None] * stride_xm
    w_base = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        xt = tl.load(x_base + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_base + kk[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(xt.to(CDT), wt.to(CDT), input_precision="ieee")
        else:
            acc += tl.dot(xt.to(CDT), wt.to(CDT))
    out = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmTiles:
    """Tile sizes and launch shape of ``_moe_gemm_kernel`` for one aligned block size."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_tiles(block_m: int, dtype: torch.dtype = torch.bfloat16) -> GemmTiles:
    """Decode-size blocks (16, 32 rows) stream the weights with wide N tiles; prefill-size blocks
    (64, 128 rows) are compute-bound and take 256-wide tiles on 8 warps (16-bit dtypes).

    NOTE: from a sweep on the H200 (``benchmarks/gpu/bench_moe.py --tune``, 38 configs): x256x64 on 8
    warps was the fastest at both 64 and 128 rows for Mixtral and Qwen3-MoE prefill (0.9-1.2x the
    per-expert cuBLAS matmuls on Mixtral's 8 big experts). fp32 tiles take twice the shared memory
    per element: prefill blocks use 128x32 tiles there, so even with every stage buffered
    (BM*BK + BK*BN) * 4 B * stages <= 96 KB (the gathered x rows are evidently not multi-buffered:
    compiled for sm90 the kernel takes 40-64 KB).
    """
    if block_m <= 32:
        return GemmTiles(block_n=128, block_k=64, num_warps=4, num_stages=3)
    if dtype == torch.float32:
        return GemmTiles(block_n=128, block_k=32, num_warps=8 if block_m == 128 else 4, num_stages=3)
    if block_m == 64:
        return GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=4)
    return GemmTiles(block_n=256, block_k=64, num_warps=8, num_stages=3)


def moe_gemm(
    x: torch.Tensor, w: torch.Tensor, blocks: AlignedBlocks, token_div: int, tiles: GemmTiles | None = None
) -> torch.Tensor:
    """x (M, K), w (E, N, K) -> out (n, N) in x's dtype, out[i] = x[i // token_div] @ w[e(i)]^T, where
    e(i) is the group of the block that holds assignment i. Rows of excluded assignments are left
    unwritten (the caller never reads them). ``tiles``: override ``default_tiles`` (tuning)."""
    assert x.dim() == 2 and w.dim() == 3 and x.shape[1] == w.shape[2], (
        f"x {tuple(x.shape)} does not fit experts {tuple(w.shape)} as (M, K), (E, N, K)"
    )
    assert x.dtype == w.dtype and x.device == w.device, "x and the expert weights: one dtype, one device"
    n, N, K = blocks.num_valid, w.shape[1], w.shape[2]
    out = torch.empty(n, N, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    t = tiles or default_tiles(blocks.block_m, x.dtype)
    grid = (blocks.num_blocks, triton.cdiv(N, t.block_n))
    _moe_gemm_kernel[grid](
        x, w, out, blocks.sorted_ids, blocks.block_group, n, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        TOKEN_DIV=token_div, BLOCK_M=blocks.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        CDT=tl_dtype(x.dtype), IEEE=x.dtype == torch.float32,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def fused_experts(layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, hook=None) -> torch.Tensor:
    """``FusedMoE.experts_forward`` on the GPU: (T, H), this rank's partial sum (``layer`` a FusedMoE).

    The weighted sum multiplies in the weights' dtype (fp32 for Mixtral) and rounds each term to
    x's dtype, as the torch path does; the k terms of a token are then summed with fp32 accumulation
    (the torch path accumulates into x's dtype in expert order: equal in fp32 up to order).
    """
    T, k = ids.shape
    E = layer.num_experts
    flat = ids.reshape(-1)
    blocks = align_by_group(flat, E, pick_block_m(flat.numel(), E, largest=128))
    h = moe_gemm(x, layer.gate_up_proj, blocks, token_div=k)  # (T*k, 2I)
    if hook is not None:
        hook.w13(h, x, ids)
    a = layer.activate(h)  # (T*k, I)
    y = moe_gemm(a, layer.down_proj, blocks, token_div=1)  # (T*k, H)
    if hook is not None:
        hook.w2(y, a, ids)
    terms = (y.view(T, k, -1) * weights.unsqueeze(-1)).to(x.dtype)
    return terms.sum(dim=1, dtype=torch.float32).to(x.dtype) if k > 1 else terms[:, 0]
