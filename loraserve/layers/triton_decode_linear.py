"""A linear layer at decode sizes (<= 32 tokens) on the GPU, optionally with every token's LoRA delta
as more columns of the same GEMM.

    y = round(round(x @ W^T + bias) + s @ B_packed^T)         (the LoRA columns: lora/layers/packed_b.py)

where s (tokens, S*R) is ``lora_shrink(expand=True)``'s output: each token's x @ A_j^T in its own slot
j's columns, zeros in the others; B_packed (N, P*S*R) is every slot's B (P = 2 bf16 planes hi + lo for
fp32 LoRA weights, 1 for bf16 ones; the P planes of B all meet the same s). The base layers call it
without LoRA where it beats cuBLAS (``prefer_over_cublas``); the LoRA layers with it
(lora/ops/triton_ops.py).

Why: at decode sizes a LoRA'd op was three launches (cuBLAS GEMM, shrink, expand), and the two LoRA
kernels cost ~10-15 µs per op on the H200 whatever they moved: launch and latency, not bytes. Here the
delta rides on the GEMM that already streams W: after a program's K blocks of W come the E = P*S*R
columns of B, through the same pipelined loads, so B's latency hides behind W's stream and the delta
costs about its bytes. Columns of slots absent from the batch are not loaded (up to 64 slots).

PDL: the kernel is a link of the decode step's chain (``utils.pdl_chain``) or the shrink's dependent:
it lets its own dependent launch at once, pulls the first K blocks of its W into L2 (nothing before
wrote W), then waits for the kernel before it to finish before reading x or s.

History (H200, Llama-8B shapes, 32 tokens, 8 fp32 adapters; BENCHMARKS.md):
- Sessions 4-7: the delta in the epilogue after the K loop (B, s and the slots loaded there, one MMA
  per chunk of slots; the GEMM read x before its wait, and waited for the shrink only before the
  epilogue). Its loads were latency nobody hid: gate_up's epilogue cost 8.0 µs on a ready buffer, for
  3.5 µs of bytes, and the LoRA cost per layer was 24.8 µs at its best (session 7).
- The shrink inside this launch (session 6, commit 71c6a33): slower, 42 vs 31 µs per layer (its
  units' loads of A delayed the first wave's stream of W).
- The delta in a launch of its own after the GEMM (session 7, commit bfb8465): slower, 36.4 vs 23.8.

Layout: the product is computed transposed, acc (BLOCK_N, BLOCK_M) = W_tile @ x_tile^T, so the long
axis (N) is the MMA's M and the few tokens its N (>= 16, padded by masking). A program owns a block of
columns; with ``split_k`` > 1 several programs share one over slices of K, one more computes the LoRA
columns alone, and the last to finish sums their partials in a fixed order (deterministic): small
layers (o_proj, qkv) have too few column blocks to keep every SM streaming W otherwise.

Numerics: fp32 accumulation, bias added in fp32, the base output rounded to y's dtype, then the delta
(s rounded to x's dtype, products in x's dtype on the tensor cores, fp32 accumulation) added and
rounded once more. This is PEFT's order, ``result = base(x); result = result + lora_B(lora_A(x)) * s``
with the fp32 sum rounded. With bf16 LoRA weights the delta's numbers are the reference's (which
rounds its intermediate to B's dtype); with fp32 ones B keeps 16 bits of mantissa (hi + lo) and s
8 (bf16), where the reference multiplies in fp32 (and the unfused kernels in tf32: 10 and 10).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    dot_in,
    pdl_chain,
    persistent_buffer,
    prefetch_l2,
    tl_dtype,
)

MAX_TOKENS = 32  # the largest batch this kernel serves (a decode step's tokens; tuned there); beyond it, cuBLAS


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
class LoRAColumns:
    """Every token's LoRA delta as E more columns of the GEMM (the module docstring).

    s: (n_slices, M, S*R) in x's dtype, ``lora_shrink(expand=True)``: the rows of tokens with a slot,
    every column written; rows of base tokens may hold anything (never loaded). b_packed: (N, P, S, R)
    in x's dtype, contiguous (``packed_b.pack_b``). token_slots: (M,) int on the device, -1 = base.
    slices: the widths of the 1-3 slices (s's first dimension), summing to N.
    """

    s: torch.Tensor
    b_packed: torch.Tensor
    token_slots: torch.Tensor
    slices: tuple[int, ...]


# Knob (a module attribute: bench_decode_linear.py --matrix sweeps it): K blocks of W each program pulls
# into L2 before its PDL wait (0: none)
PREFETCH_BLOCKS = int(os.environ.get("LORASERVE_PREFETCH_W", "4"))


def default_tiles(M: int, N: int, K: int, dtype: torch.dtype) -> DecodeTiles:
    """The tiles for a (M, K) x (N, K)^T product at M <= 32 tokens.

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
def _or(a, b):
    return a | b


@triton.jit
def _lora_slice(pid_n, N0, N1, NUM_SLICES: tl.constexpr, BLOCK_N: tl.constexpr):
    """The slice (0-2) of column block pid_n (BLOCK_N divides every slice: a block lies in one)."""
    col0 = pid_n * BLOCK_N
    sl = pid_n * 0
    if NUM_SLICES > 1:
        sl += (col0 >= N0).to(tl.int32)
    if NUM_SLICES > 2:
        sl += (col0 >= N0 + N1).to(tl.int32)
    return sl


# NOTE: sizes are specialized (not do_not_specialize): Triton then knows K and the strides are multiples
# of 16 and vectorizes the loads; only M (the token count) is a runtime value.
@triton.jit(do_not_specialize=["M"])
def _decode_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    ws_ptr,  # fp32 (PARTS, n_blocks, BLOCK_N, BLOCK_M): split-K partials (PARTS > 1)
    cnt_ptr,  # int32 (n_blocks,): arrivals per column block, zero between launches (PARTS > 1)
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    # the LoRA columns (E > 0): s (n_slices, M, SR) and B packed (N, E), both in x's dtype
    s_ptr,
    bp_ptr,
    slots_ptr,
    N0,
    N1,
    stride_ss,
    stride_sm,
    stride_bpn,
    E: tl.constexpr,  # LoRA columns: P planes x S slots x R ranks (HAS_LORA)
    SR: tl.constexpr,  # S x R: s's columns (plane p of B meets s's columns e % SR)
    R: tl.constexpr,
    NSLOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_W: tl.constexpr,
    PARTS: tl.constexpr,  # programs per column block: SPLIT_W, + 1 (the delta alone) with LoRA and SPLIT_W > 1
    HAS_LORA: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
    LINK: tl.constexpr,  # a PDL dependent (a link of the step's chain, or the shrink's dependent): wait first
    PREFETCH: tl.constexpr,  # K blocks of this program's W pulled into L2 before the wait
    LINE: tl.constexpr,  # elements of W per 128-byte line
):
    pid = tl.program_id(0)
    pid_n = pid // PARTS
    part = pid % PARTS
    if part < SPLIT_W:
        k_lo = part * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    else:  # the delta program: no columns of W
        k_lo = pid * 0
        k_hi = pid * 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if LINK:
        tl.extra.cuda.gdc_launch_dependents()
        if PREFETCH > 0:
            # W does not depend on the kernel before: start streaming it while that kernel finishes
            cols = tl.minimum(k_lo + tl.arange(0, PREFETCH * BLOCK_K // LINE) * LINE, K - 1)
            prefetch_l2(w_ptr + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn + cols[None, :])
        tl.extra.cuda.gdc_wait()  # x (and s) only once the kernel before has finished and flushed

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if HAS_LORA:
        # One loop over this program's K columns, then (if it owns the delta) the E LoRA columns: the
        # slots' B stream through the same pipelined loads as W, and s replaces x.
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        sl = _lora_slice(pid_n, N0, N1, NUM_SLICES, BLOCK_N)
        b_rows = bp_ptr + offs_n[:, None].to(tl.int64) * stride_bpn
        x_rows = x_ptr + offs_m[:, None] * stride_xm
        s_rows = s_ptr + sl * stride_ss + offs_m[:, None] * stride_sm
        slot = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int32)
        has_slot = slot >= 0  # rows of base tokens in s hold anything: never loaded
        if NSLOT <= 64:
            # the slots in this batch: the columns of the others are not loaded (they would meet zeros)
            present = tl.reduce(tl.where(has_slot, tl.full((BLOCK_M,), 1, tl.int64) << slot.to(tl.int64), 0), 0, _or)
        n_base = (tl.maximum(k_hi - k_lo, 0) + BLOCK_K - 1) // BLOCK_K
        n_lora = (E + BLOCK_K - 1) // BLOCK_K
        if SPLIT_W == 1:
            n_iter = n_base + n_lora
        else:  # only the delta program (no columns of W) owns the LoRA columns
            n_iter = n_base + tl.where(part == SPLIT_W, n_lora, 0)
        out_dt = y_ptr.dtype.element_ty
        for it in range(0, n_iter):
            is_lora = it >= n_base
            kb = k_lo + it * BLOCK_K + offs_k
            e = (it - n_base) * BLOCK_K + offs_k
            k_ok = tl.where(is_lora, e < E, kb < k_hi)
            w_ok = k_ok
            if NSLOT <= 64:
                w_ok = tl.where(is_lora, k_ok & (((present >> ((e % SR) // R).to(tl.int64)) & 1) != 0), k_ok)
            w = tl.load(
                tl.where(is_lora, b_rows, w_rows) + tl.where(is_lora, e, kb)[None, :],
                mask=n_mask[:, None] & w_ok[None, :],
                other=0.0,
            )
            xt = tl.load(
                tl.where(is_lora, s_rows, x_rows) + tl.where(is_lora, e % SR, kb)[None, :],
                mask=tl.where(is_lora, m_mask & has_slot, m_mask)[:, None] & k_ok[None, :],
                other=0.0,
            )
            if SPLIT_W == 1:
                # PEFT's order: the base output (+ bias) is rounded to y's dtype before the delta is added
                acc = tl.where(it == n_base, (acc + bias[:, None]).to(out_dt).to(tl.float32), acc)
            acc += dot_in(w, tl.trans(xt), CDT, IEEE)
        if SPLIT_W == 1:
            _store(acc, pid_n, y_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N)
            return
    else:
        w_ptrs = w_rows + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
        for k in range(k_lo, k_hi, BLOCK_K):
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
        if SPLIT_W == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            _store(acc, pid_n, y_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N)
            return

    # Serial split-K: every part writes its partial to its own plane; the last of a column block to
    # arrive sums the base planes in plane order (deterministic, whoever is last), adds the bias, rounds,
    # then adds the delta program's plane (with LoRA) and rounds again, as the unsplit path does.
    # NOTE: CUTLASS's semaphore pattern: all threads' stores, a CTA barrier, then one acq_rel atomic
    # at GPU scope publishes them; the last arrival reads the planes past L1 (.cg), which is not
    # coherent across SMs, and puts the counter back to zero for the next launch.
    tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
    plane = tl.cdiv(N, BLOCK_N) * (BLOCK_N * BLOCK_M)  # elements of one part's plane
    tl.store(ws_ptr + part * plane + pid_n * (BLOCK_N * BLOCK_M) + tile, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == PARTS - 1:
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for sp in tl.static_range(SPLIT_W):
            total += tl.load(ws_ptr + sp * plane + pid_n * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if HAS_LORA:
            delta = tl.load(ws_ptr + SPLIT_W * plane + pid_n * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            total = total.to(y_ptr.dtype.element_ty).to(tl.float32) + delta
        _store(total, pid_n, y_ptr, M, N, stride_ym, BLOCK_M, BLOCK_N)


@triton.jit
def _store(acc, pid_n, y_ptr, M, N, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc (BLOCK_N, BLOCK_M), this program's columns for every token, rounded to y's dtype and stored."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


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
        t = tiles or default_tiles(x.shape[0], N, K, x.dtype)
        if len(slices) > 3 or sum(slices) != N or any(n % t.block_n for n in slices):
            return False
    return True


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    lora: LoRAColumns | None = None,
    tiles: DecodeTiles | None = None,
    pdl_dependent: bool = False,
) -> torch.Tensor:
    """y (M, N) = x (M, K) @ weight (N, K)^T (+ bias) (+ the LoRA delta of ``lora``), in x's dtype.

    M <= MAX_TOKENS (a decode step); x and weight bf16/fp16, contiguous along K (``supports`` says which).
    ``pdl_dependent``: launch as a PDL dependent of the kernel before (the LoRA shrink, which lets it
    launch at once) even when the step's chain is off; it waits for that kernel before reading x or s.
    """
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape == (N, K), f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
    assert 0 < M <= MAX_TOKENS, f"decode_linear serves 1 to {MAX_TOKENS} tokens, got {M}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight must be contiguous along K"
    assert bias is None or (bias.shape == (N,) and bias.stride(0) == 1)
    tiles = tiles or default_tiles(M, N, K, x.dtype)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cdt = compute_dtype_of(x.dtype, weight.dtype)
    lora_args: tuple = (x, x, x, 0, 0, 0, 0, 0)
    lora_consts = dict(E=1, SR=1, R=1, NSLOT=1, NUM_SLICES=1, HAS_LORA=False)
    if lora is not None:
        n_sl, m_s, sr = lora.s.shape
        bp = lora.b_packed
        assert 1 <= n_sl <= 3 and len(lora.slices) == n_sl and m_s == M, f"s {tuple(lora.s.shape)} does not fit"
        assert lora.s.dtype == x.dtype and lora.s.stride(2) == 1
        assert sum(lora.slices) == N and all(n % tiles.block_n == 0 for n in lora.slices), (
            f"slices {lora.slices} must sum to N={N} and be multiples of block_n={tiles.block_n}"
        )
        assert bp.dim() == 4 and bp.shape[0] == N and bp.is_contiguous() and bp.dtype == x.dtype, (
            f"b_packed {tuple(bp.shape)} {bp.dtype}: (N={N}, P, S, R) contiguous in {x.dtype}"
        )
        _, planes, n_slots, R = bp.shape
        assert n_slots * R == sr, f"s has {sr} columns, B packed {n_slots} slots x rank {R}"
        assert lora.token_slots.shape == (M,)
        lora_args = (
            lora.s, bp, lora.token_slots, lora.slices[0], lora.slices[1] if n_sl > 1 else 0,
            lora.s.stride(0), lora.s.stride(1), bp.stride(0),
        )  # fmt: skip
        lora_consts = dict(E=planes * sr, SR=sr, R=R, NSLOT=n_slots, NUM_SLICES=n_sl, HAS_LORA=True)
    link = pdl_chain(x.device) or pdl_dependent
    block_m = _block_m(M)
    n_blocks = triton.cdiv(N, tiles.block_n)
    split = tiles.split_k
    parts = split + 1 if lora is not None and split > 1 else split
    k_per_split = triton.cdiv(triton.cdiv(K, split), tiles.block_k) * tiles.block_k
    ws, cnt = (x, x)
    if parts > 1:
        ws = persistent_buffer(x.device, "decode_linear/partials", parts * n_blocks * tiles.block_n * block_m, torch.float32)
        cnt = persistent_buffer(x.device, "decode_linear/arrivals", n_blocks)
    _decode_linear_kernel[(n_blocks * parts,)](
        x, weight, bias if bias is not None else x, y, ws, cnt, M, N, K, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0),
        *lora_args,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, SPLIT_W=split, PARTS=parts,
        EVEN_K=K % tiles.block_k == 0, EVEN_N=N % tiles.block_n == 0,
        CDT=tl_dtype(cdt), IEEE=cdt == torch.float32,
        LINK=link, PREFETCH=PREFETCH_BLOCKS if link else 0, LINE=128 // x.element_size(),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, launch_pdl=link,
        **lora_consts,
    )  # fmt: skip
    return y
