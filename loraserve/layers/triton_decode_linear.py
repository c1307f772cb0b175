"""A linear layer at decode sizes (<= 32 tokens) on the GPU, with an optional per-token low-rank
epilogue: the LoRA expand, in the same launch as the GEMM.

    y = round(x @ W^T + bias) + sum_i B_i[slot(t)] (s_i[t])      (slice i owns columns [off_i, off_i + N_i))

where ``s`` is ``lora_shrink``'s output (x @ A_i[slot(t)]^T in fp32, its split-K planes summed by the shrink or
here). The base layers call it without the epilogue where it beats cuBLAS (``prefer_over_cublas``); the LoRA
layers call it with the epilogue (lora/ops/triton_ops.py), or, for a small model's gate_up, without it as the
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

NOTE: measured slower on the H200 (Llama-8B shapes, 32 tokens, 8 adapters) and removed, each kept in git:
- the shrink inside this launch, in four forms: the first programs computing the shrink's units before their
  K loop (their loads of A delayed the first wave's stream of W, where a shrink launch's A loads overlap the
  previous kernel's tail: 42 vs 31 µs of LoRA cost per layer); the shrink as this launch's first programs (each
  held a whole SM's shared memory, pushing the short GEMMs into a second wave: 33.7 vs 24.9 µs); the shrink's
  units streamed beside W inside the K loop (qkv 21.9 vs 18.8 µs a launch); and the GEMM launched as its shrink
  starts, pulling W into L2 and spinning until x was ready (its programs held SMs the kernels before wanted);
- the delta as more K columns of this GEMM on every layer (reading s in the pipelined loop made the GEMM wait
  for the whole shrink first; a plain form of it serves small models' gate/up: ``lora/ops/delta_in_k.py``);
- B pulled into L2 before the K loop (it competed with the stream of W), a register cap on the LoRA variant,
  the delta computed a few K steps before the loop's end or by every split before its arrival, helper
  programs adding the first wave's deltas, and the delta precomputed in the shrink's launch (the same LoRA
  cost, and its spinning programs slowed the step).
Kernel timestamps (``bench_decode_linear.py --trace``) show why a launch of its own is cheap: the GEMM starts
within 0.4 µs of the kernel before it ending, and the shrink runs beside its K loop. Most of the LoRA cost is
the epilogue, which waits on its loads after the K loop: Nsight Compute's warp-state samples (qkv with bf16 B
on a ready buffer) put the K loop at the same samples with and without LoRA, and after it one round trip for s
and B (``expand_block.slot_columns``: s gathered straight into its
slot's columns and loaded before B) and the MMA's wait.

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.decode_linear_kernel import decode_linear_kernel
from loraserve.lora.ops.triton.expand_block import slots_per_chunk
from loraserve.lora.ops.triton.utils import (
    compute_dtype_of,
    interpreted,
    pdl_chain,
    persistent_buffer,
    tl_dtype,
    use_pdl,
)

# K steps before the end of its K loop at which each LoRA'd program pulls its epilogue's B into L2, by B's dtype
# (``prefetch_ahead``; 0: never). The epilogue on a ready buffer costs 1.6-5.8 µs an op (H200, bf16 B) where B's
# bytes take 0.3-1.7: mostly its load's latency after the loop. Timed (LoRA cost per layer): bf16 B 17.5 vs 17.9 µs
# at 4 steps; fp32 B 27.6 at 4 and 27.3 at 2 vs 24.9 (its B is twice the lines), so half-precision B only.
PREFETCH_B_AHEAD = 4


def prefetch_ahead(b_dtype: torch.dtype) -> int:
    """The K steps before the loop's end at which B of this dtype is pulled into L2 (PREFETCH_B_AHEAD)."""
    return 0 if b_dtype == torch.float32 else PREFETCH_B_AHEAD


MAX_TOKENS = 32  # the largest batch this kernel serves (a decode step's tokens; tuned there); beyond it, cuBLAS
# A product whose 64-row blocks would take more programs than the GPU has SMs (``sm_count``; one program an SM:
# their 120 KB of shared memory), but whose 128-row blocks fit, runs in one wave of 128-row blocks
# (``default_tiles``). Why: a PDL dependent launches once every program of its predecessor has started, so behind
# a two-wave GEMM (Qwen2.5-0.5B's gate/up: 152 blocks) the SiLU-and-mul starts only 2.7 µs before the GEMM ends.
# Measured (H100, Qwen2.5-0.5B, 32 tokens, CUDA graphs): graph replay base 1.05 -> 1.01 ms, 8 adapters 1.26 -> 1.24.
ONE_WAVE_SMS = 132  # where no CUDA device answers (the interpreter): the H100 SXM's and H200's SMs
# A GEMM that is an ordinary link of the PDL chain (it waits for the kernel before it before its K loop) first asks
# L2 for its rows of W over its K range, a prefetch per 128-byte line (weights: nothing in the chain writes them),
# so that after the wait its K loop meets L2's latency, not DRAM's: a link launches while the kernel before it runs
# (a norm, the attention, the SiLU-and-mul: a few µs), and its programs sit idle until that kernel ends. Measured
# (H100, Qwen2.5-0.5B, 32 tokens, 8 adapters, CUDA graphs, step_trace): 8 adapters 1.195 -> 1.172 ms. Only for a W
# of at most W_PREFETCH_MAX_BYTES: the resident programs pull all of their rows at once, which must fit in L2 beside
# what the step's other kernels keep there (the H100's and H200's L2: 50 MB; Qwen2.5-0.5B's gate/up 17 MB,
# Llama-8B's qkv 50 MB)
W_PREFETCH_MAX_BYTES = 24 << 20


def w_prefetch_lines(weight: torch.Tensor, shrink_rows: int, k_per_split: int) -> int:
    """The 128-byte lines along K of each of its rows that a decode GEMM, a waiting link of the PDL chain, pulls
    into L2 before its wait: 0 where W and the shrink's rows of A pass W_PREFETCH_MAX_BYTES, or under the
    interpreter (the prefetch is inline PTX); at most 32 (4 KB a row of bf16)."""
    nbytes = (weight.shape[0] + shrink_rows) * weight.shape[1] * weight.element_size()
    if nbytes > W_PREFETCH_MAX_BYTES or interpreted():
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


# NOTE: compiled as launched the LoRA variant takes 128-134 registers without spills, and shared memory, not
# registers, bounds its programs per SM (benchmarks/gpu/kernel_resources.py).


def default_tiles(M: int, N: int, K: int, dtype: torch.dtype, slices: tuple[int, ...] | None = None) -> DecodeTiles:
    """The tiles for a (M, K) x (N, K)^T product at M <= 32 tokens; ``slices``: the widths of its LoRA slices,
    where the GEMM adds their delta (the one-wave tiles only where they divide every slice).

    From the sweep of ``benchmarks/gpu/bench_decode_linear.py --tune`` on the H200 (Llama-8B shapes, 32
    tokens, bf16; µs, ours vs cuBLAS): 64-row blocks of W, 128-wide K steps, 5 stages on 4
    warps for qkv (16.6 vs 17.4); the same split over K in 2 for o (13.0 vs 14.9) and down (32.4 vs
    34.1), whose 64 column blocks alone leave half the 132 SMs idle; 4 stages for gate_up (59.3 vs
    58.5); 128-row blocks on 8 warps for lm_head (243 vs 257). Hence: split K until there are about
    128 programs (at most 4 ways, each split at least two K steps); and one wave of 128-row blocks where
    64-row blocks would take two (the note at ``ONE_WAVE_SMS``).
    """
    if N > 65536:
        return DecodeTiles(block_n=128, block_k=128, num_warps=8, num_stages=4)
    if N > 16384:
        return DecodeTiles(block_n=64, block_k=128, num_warps=4, num_stages=4)
    blocks = triton.cdiv(N, 64)
    if blocks > sm_count() >= triton.cdiv(N, 128) and not any(n % 128 for n in slices or ()):
        return DecodeTiles(block_n=128, block_k=128, num_warps=8, num_stages=4)  # lm_head's tiles, in one wave
    split = max(1, min(4, 128 // blocks, K // 256))
    return DecodeTiles(block_n=64, block_k=128, num_warps=4, num_stages=5, split_k=split)


def prefer_over_cublas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a base layer (no LoRA) should take ``decode_linear`` instead of cuBLAS: where the sweep
    measured it faster (see ``default_tiles``: N <= 16384 and the vocabulary-sized lm_head); in
    between (gate_up at 28672) cuBLAS was as fast or faster."""
    N = weight.shape[0]
    return (N <= 16384 or N > 65536) and supports(x, weight)


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
    its own wait, may read what that kernel wrote (the norm's shrink of x: the rotary launch's qkv delta,
    ``rotary_kv_cache(delta=...)``).
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
    decode_linear_kernel[(n_blocks * split,)](
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
