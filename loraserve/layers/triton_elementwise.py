"""The per-layer elementwise ops on the GPU, one launch each: RMSNorm (optionally fused with the
residual add before it), SiLU-and-mul, rotary (optionally fused with the KV-cache write after it).

In torch each is a chain of small kernels (RMSNorm ~6, rotary ~10 per layer); at decode sizes every
launch costs a few µs whatever it moves, which made these ops ~3 ms of an 8B decode step's 8 ms on
the H200 (``benchmarks/gpu/bench_e2e.py``'s kernel breakdown), more than the attention.

Each kernel computes in fp32 and rounds to the storage dtype where the torch path (and HF) rounds.
Measured on the H200 in bf16 (tests/gpu/test_triton_elementwise.py): RMSNorm and SiLU-and-mul within
one bf16 step of the torch path; rotary off by one bf16 step of a product on ~2% of outputs (the
compiler evidently keeps a product unrounded: an FMA), relative error ~3e-3:

- RMSNorm: h = x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then times the weight,
  rounded to the result dtype of (weight, x) as ``weight * h.to(dtype)`` is.
- SiLU-and-mul: silu(gate) rounded to x's dtype, then times up, rounded.
- rotary (rotate-half layout): with cos/sin already in x's dtype, each product rounded, then the
  sum rounded (x1*cos - x2*sin, x2*cos + x1*sin); dims past rotary_dim copied.
- fused add + RMSNorm (vLLM's ``fused_add_rms_norm``): residual' = x + residual added in fp32 and
  rounded once to the dtype (what torch's ``x + residual`` does, so residual' is bit-equal to it),
  then RMSNorm of residual' exactly as above.
- rotary + KV-cache write: the rotary above for q and k (the same jit helper, so the same roundings),
  rotated k and unrotated v stored into the paged cache rows ``slot_mapping`` (what
  ``k_cache[slot_mapping] = k`` does): one launch instead of three.

Per decoder layer on the GPU path that is 4 small launches (add+norm, rotary+cache, add+norm,
SiLU-and-mul) instead of 8. The shared ``@triton.jit`` helpers (``rms_norm_row``, ``_rotate_half``)
keep each fused kernel's arithmetic the same as its unfused twin's.

On Hopper each of them (but the plain rotary) is a link of the decode step's PDL chain
(``utils.pdl_chain``): launched while the kernel before it runs, it lets the next kernel launch at
once and waits before touching memory (but for what the chain never writes, which a link may load before its
wait: a pending LoRA delta's B and slot, and the norm's weight). The launch gaps between them are hidden, and a
LoRA shrink after a norm or SiLU-and-mul loads its A while they run.

Imported only on CUDA (or under TRITON_INTERPRET=1 in tests): CPU installs have no triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton import row_delta
from loraserve.lora.ops.triton.row_delta import delta_b_tile, delta_of, plus, plus_delta, shrunk_row
from loraserve.lora.ops.triton.utils import pdl_chain, pdl_link, tl_dtype

# Elements of a norm's row a warp holds. Every norm kernel (plain, with a pending LoRA delta, with a shrink:
# ``norm_shrink``) takes its warps from ``norm_warps``, so they lay the row out alike and sum its variance in one
# order: the same bits. At 128 the kernels with a delta fit in registers at Qwen's 896 (``kernel_resources.py
# --norm-delta``: 255 registers and 112-120 spill bytes a thread at 4 warps, 80-172 and none at 8). Measured against
# 256 (H100, Qwen2.5-0.5B, 32 tokens, 8 adapters, CUDA graphs): step_trace 1.261 -> 1.245 ms; the base step unchanged
NORM_ROW_PER_WARP = 128


def norm_warps(block: int) -> int:
    """The warps of a norm kernel over a row of ``block`` (a power of 2) elements."""
    return min(16, max(1, block // NORM_ROW_PER_WARP))


# NOTE: the norm kernels load their weight before their PDL wait (a weight: nothing in the chain writes it), not
# once the variance's sum is done, which put a round trip to memory on the path between the kernel before and the
# one after. The same numbers. Measured (H100, Qwen2.5-0.5B, 32 tokens, 8 adapters, CUDA graphs, step_trace): base
# 0.967 -> 0.952 ms, 8 adapters 1.195 -> 1.184.


@triton.jit
def rms_rstd(xf, N, eps):
    """1 / sqrt(mean(xf^2) + eps) of a row in fp32 (masked lanes 0): the number ``rms_norm_row`` scales by."""
    var = tl.sum(xf * xf, axis=0) / N
    return 1.0 / tl.sqrt_rn(var + eps)


@triton.jit
def rms_norm_row(x, w, N, eps, rstd=None):
    """One row ``x`` in its storage dtype (masked lanes 0) -> weight * RMSNorm(x), in fp32 (the caller
    rounds it to the output dtype): normalized in fp32, rounded to x's dtype, then times the weight ``w``
    (the row's, loaded by the caller before its PDL wait). ``rstd``: the row's ``rms_rstd`` where the caller
    has it (None: computed here; the same bits either way)."""
    xf = x.to(tl.float32)
    if rstd is None:
        rstd = rms_rstd(xf, N, eps)
    h = (xf * rstd).to(x.dtype)
    return w.to(tl.float32) * h.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr, PDL_CHAIN: tl.constexpr):
    # a link of the step's PDL chain (utils.pdl_chain): touches memory only after its wait, but for its weight
    if PDL_CHAIN:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if PDL_CHAIN:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    out = rms_norm_row(x, w, N, eps)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, r_out_ptr, stride_x, stride_r, stride_o, stride_ro, N, eps, BLOCK: tl.constexpr,
    PDL_CHAIN: tl.constexpr,
    # x's pending LoRA delta (row_delta: the row-parallel projection that wrote x left it to this launch)
    d_buf_ptr, d_b_ptr, d_slots_ptr, stride_dbs, stride_dsp, stride_dsm, stride_dss, D_P, D_R,
    HAS_DELTA: tl.constexpr,
    D_BLOCK_R: tl.constexpr, D_RED: tl.constexpr, D_CDT: tl.constexpr,
):
    # a link of the step's PDL chain (utils.pdl_chain): touches memory only after its wait, but for its weight
    # and the pending delta's B and slot (weights and the mapping, written before the forward)
    if PDL_CHAIN:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        slot, bt = delta_b_tile(d_b_ptr, d_slots_ptr, row, stride_dbs, offs, mask, D_R, D_BLOCK_R)
    if PDL_CHAIN:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        x = plus_delta(x, bt, slot, d_buf_ptr, row, stride_dsp, stride_dsm, stride_dss, D_P, D_R, D_BLOCK_R, D_RED, D_CDT)
    x = x.to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(r_out_ptr.dtype.element_ty)  # torch's x + residual: fp32 add, one rounding
    tl.store(r_out_ptr + row * stride_ro + offs, h, mask=mask)
    out = rms_norm_row(h, w, N, eps)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) over the last dim, in one launch; both new tensors.

    x and residual: the same shape and dtype (any leading shape). The sum is bit-equal to torch's
    ``x + residual``; the norm output equals ``rms_norm`` of that sum (dtype: that of weight * x).
    ``delta``: x's pending LoRA delta (a ``punica.PendingDelta``, ``row_delta.supports`` it; x (T, N)),
    added to x first (``row_delta``'s numbers: x + delta rounded, then the above).
    """
    N = x.shape[-1]
    assert residual.shape == x.shape and residual.dtype == x.dtype, (
        f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}"
    )
    assert weight.shape == (N,), f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
    tl_dtype(x.dtype)
    x2, r2 = x.reshape(-1, N), residual.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        chain = pdl_chain(x.device)
        _fused_add_rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, r_out, x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0), N, eps,
            BLOCK=block, PDL_CHAIN=chain, num_warps=norm_warps(block), launch_pdl=chain,
            **row_delta.kernel_args(delta, x2),
        )  # fmt: skip
    return out.view(x.shape), r_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape, last dim contiguous)."""
    N = x.shape[-1]
    assert weight.shape == (N,), f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}"
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        chain = pdl_chain(x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), N, eps, BLOCK=block, PDL_CHAIN=chain,
            num_warps=norm_warps(block), launch_pdl=chain,
        )  # fmt: skip
    return out.view(*x.shape[:-1], N)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D, BLOCK: tl.constexpr, PDL_CHAIN: tl.constexpr):
    if PDL_CHAIN:  # a link of the step's PDL chain (utils.pdl_chain): touches memory only after its wait
        pdl_link(True)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2d) -> (..., d): silu(x[..., :d]) * x[..., d:]."""
    D2 = x.shape[-1]
    assert D2 % 2 == 0, f"last dim {D2} is not even: silu_and_mul needs (gate, up) halves"
    D = D2 // 2
    x2 = x.reshape(-1, D2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], D, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(D))
        chain = pdl_chain(x.device)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(D, block))](
            x2, out, x2.stride(0), out.stride(0), D, BLOCK=block, PDL_CHAIN=chain, num_warps=4, launch_pdl=chain
        )
    return out.view(*x.shape[:-1], D)


@triton.jit
def _rotate_half(x1, x2, c, s):
    """One head's halves x1, x2 (storage dtype) rotated by cos/sin halves c, s (the same dtype):
    (x1*cos - x2*sin, x2*cos + x1*sin), each product rounded to the dtype, then the sum rounded."""
    dt = x1.dtype
    x1, x2, c, s = x1.to(tl.float32), x2.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
    a = (x1 * c).to(dt).to(tl.float32)
    b = (-x2 * s).to(dt).to(tl.float32)
    o1 = (a + b).to(dt)
    a = (x2 * c).to(dt).to(tl.float32)
    b = (x1 * s).to(dt).to(tl.float32)
    return o1, (a + b).to(dt)


@triton.jit
def _rotate_row(x_row, o_row, c, s, offs, mask, HALF, D, REST_BLOCK: tl.constexpr, d1, d2, d_rest):
    """Rotate one head at x_row (rotary dims [0, 2*HALF)) into o_row; dims [2*HALF, D) copied. d1, d2, d_rest
    (fp32, or None): a LoRA delta added to the head's halves and rest first (``row_delta.plus``)."""
    x1 = plus(tl.load(x_row + offs, mask=mask, other=0.0), d1)
    x2 = plus(tl.load(x_row + HALF + offs, mask=mask, other=0.0), d2)
    o1, o2 = _rotate_half(x1, x2, c, s)
    tl.store(o_row + offs, o1, mask=mask)
    tl.store(o_row + HALF + offs, o2, mask=mask)
    if REST_BLOCK > 0:
        r = 2 * HALF + tl.arange(0, REST_BLOCK)
        rmask = r < D
        tl.store(o_row + r, plus(tl.load(x_row + r, mask=rmask, other=0.0), d_rest), mask=rmask)


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_c,
    HALF,
    D,
    ROT_BLOCK: tl.constexpr,
    REST_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, ROT_BLOCK)
    mask = offs < HALF
    # cos/sin rows are cat(f, f): the first half serves both halves
    c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0)
    x_row = x_ptr + t * stride_xt + hd * stride_xh
    o_row = out_ptr + t * stride_ot + hd * stride_oh
    _rotate_row(x_row, o_row, c, s, offs, mask, HALF, D, REST_BLOCK, None, None, None)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, rotary_dim) in x's dtype (rows cat(f, f)); a new tensor."""
    T, H, D = x.shape
    rd = cos.shape[-1]
    assert cos.shape == sin.shape == (T, rd) and rd % 2 == 0 and rd <= D, (
        f"cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}"
    )
    assert cos.dtype == x.dtype and cos.stride(-1) == 1 and sin.stride() == cos.stride(), "cos/sin: x's dtype, rows"
    tl_dtype(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        half = rd // 2
        rest = D - rd
        _rotary_kernel[(T, H)](
            x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), half, D,
            ROT_BLOCK=triton.next_power_of_2(half), REST_BLOCK=triton.next_power_of_2(rest) if rest else 0,
            num_warps=1,
        )  # fmt: skip
    return out


@triton.jit
def _rotary_kv_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cs, stride_ch, stride_c, Hq, HALF, D,
    ROT_BLOCK: tl.constexpr, REST_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, PDL_CHAIN: tl.constexpr,
    # qkv's pending LoRA delta (``row_delta.qkv_kernel_args``): its shrink's buf (q's, k's, v's slices), their B
    # stacks and the tokens' slots; buf is complete before this launch starts (see rotary_kv_cache)
    d_buf_ptr, dbq_ptr, dbk_ptr, dbv_ptr, d_slots_ptr, stride_dbq, stride_dbk, stride_dbv, stride_dsp, stride_dsi,
    stride_dsm, D_P, D_R, HAS_DELTA: tl.constexpr, D_BLOCK_R: tl.constexpr, D_RED: tl.constexpr, D_CDT: tl.constexpr,
):  # fmt: skip
    # a link of the step's PDL chain (utils.pdl_chain): touches memory only after its wait, but for the delta's
    # operands (weights, the mapping, and the shrink its predecessor's own wait covered)
    if PDL_CHAIN:
        pdl_link(not HAS_DELTA)
    # grid (T, Hq + Hk): program (t, h) rotates q head h (h < Hq) into q_out, or k head h - Hq into the
    # cache row slot_mapping[t] and copies v head h - Hq there too
    t = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, ROT_BLOCK)
    mask = offs < HALF
    d = tl.arange(0, D_BLOCK)
    dmask = d < D
    if HAS_DELTA:  # this head's delta, before the wait: q's columns of B (slice 0), or k's (1) and v's (2)
        kh = tl.maximum(hd - Hq, 0)
        if hd < Hq:  # (`hd * 0 + c`: both branches give a variable the same type)
            b_ptr, col, stride_b, sl = dbq_ptr, hd * D, stride_dbq, hd * 0
        else:
            b_ptr, col, stride_b, sl = dbk_ptr, kh * D, stride_dbk, hd * 0 + 1
        slot, b1 = delta_b_tile(b_ptr, d_slots_ptr, t, stride_b, col + offs, mask, D_R, D_BLOCK_R)
        _, b2 = delta_b_tile(b_ptr, d_slots_ptr, t, stride_b, col + HALF + offs, mask, D_R, D_BLOCK_R)
        s_h = shrunk_row(slot, d_buf_ptr + sl * stride_dsi, t, stride_dsp, stride_dsm, 0, D_P, D_R, D_BLOCK_R, D_RED,
                         D_CDT)  # fmt: skip
        d1 = delta_of(b1, s_h)
        d2 = delta_of(b2, s_h)
        if REST_BLOCK > 0:
            r_offs = 2 * HALF + tl.arange(0, REST_BLOCK)
            _, b_rest = delta_b_tile(b_ptr, d_slots_ptr, t, stride_b, col + r_offs, r_offs < D, D_R, D_BLOCK_R)
            d_rest = delta_of(b_rest, s_h)
        else:
            d_rest = None
        _, bv = delta_b_tile(dbv_ptr, d_slots_ptr, t, stride_dbv, kh * D + d, dmask & (hd >= Hq), D_R, D_BLOCK_R)
        v_slot = tl.where(hd >= Hq, slot, -1)  # a q head has no v: nothing loaded, zeros
        s_v = shrunk_row(v_slot, d_buf_ptr + 2 * stride_dsi, t, stride_dsp, stride_dsm, 0, D_P, D_R, D_BLOCK_R, D_RED,
                         D_CDT)  # fmt: skip
        dv = delta_of(bv, s_v)
        if PDL_CHAIN:
            tl.extra.cuda.gdc_wait()
    else:
        d1, d2, d_rest, dv = None, None, None, None
    c = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0)  # rows cat(f, f): first half
    s = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0)
    if hd < Hq:
        _rotate_row(
            q_ptr + t * stride_qt + hd * stride_qh, q_out_ptr + t * stride_ot + hd * stride_oh,
            c, s, offs, mask, HALF, D, REST_BLOCK, d1, d2, d_rest,
        )  # fmt: skip
    else:
        kh = hd - Hq
        cache_slot = tl.load(slot_ptr + t).to(tl.int64)
        _rotate_row(
            k_ptr + t * stride_kt + kh * stride_kh, k_cache_ptr + cache_slot * stride_cs + kh * stride_ch,
            c, s, offs, mask, HALF, D, REST_BLOCK, d1, d2, d_rest,
        )  # fmt: skip
        v = plus(tl.load(v_ptr + t * stride_vt + kh * stride_vh + d, mask=dmask, other=0.0), dv)
        tl.store(v_cache_ptr + cache_slot * stride_cs + kh * stride_ch + d, v, mask=dmask)


def _rotary_warps(delta, D: int) -> int:
    """One warp a head; with qkv's delta, one per 1024 elements of a head's B tile (head_dim x 16-wide ranks): compiled
    for sm_90 on one warp, head_dim 64 at rank 16 took 72 registers, head_dim 128 255 (216 bytes of spill at rank
    64; ``kernel_resources.py --early``)."""
    if delta is None:
        return 1
    block_r = max(16, triton.next_power_of_2(delta.buf.shape[3]))
    return min(8, max(1, triton.next_power_of_2(D) * block_r // 1024))


def rotary_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    delta=None,
) -> torch.Tensor:
    """Rotate q and k by cos/sin, write rotated k and v into the paged cache; return rotated q. One launch.

    q (T, Hq, D), k and v (T, Hk, D): any token/head strides (e.g. views of the qkv projection's
    output), head_dim contiguous. cos/sin (T, rotary_dim) in q's dtype, rows cat(f, f) (as
    ``RotaryEmbedding.cos_sin`` gives them); dims past rotary_dim pass through unrotated. k_cache and
    v_cache (num_slots, Hk, D) in q's dtype; slot_mapping (T,) integer, every entry a valid slot
    (CUDA-graph padding rows point at a scratch slot). Afterwards ``k_cache[slot_mapping]`` holds
    ``rotate_torch(k, cos, sin)`` and ``v_cache[slot_mapping]`` holds v, exactly as the torch path's
    ``k_cache[slot_mapping] = k`` after ``rotary`` leaves them; the returned q (T, Hq, D) equals
    ``rotary(q, cos, sin)``. No host syncs: capturable in CUDA graphs.

    ``delta``: the qkv projection's pending LoRA delta (a ``punica.PendingQKVDelta``; q, k and v views of its
    output), added to q, k and v first (``row_delta``'s numbers: each rounded once, then rotated or stored).
    Each program computes its head's delta before its PDL wait, so delta's buf must be complete before this
    launch can start: the kernel before it waited for buf's writer before letting it launch
    (``decode_linear(trigger_after_wait=True)``), or no PDL.
    """
    T, Hq, D = q.shape
    Hk = k.shape[1]
    rd = cos.shape[-1]
    assert k.shape == v.shape == (T, Hk, D), f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}"
    assert cos.shape == sin.shape == (T, rd) and rd % 2 == 0 and rd <= D, (
        f"cos/sin {tuple(cos.shape)} do not fit q {tuple(q.shape)}"
    )
    assert cos.dtype == q.dtype and cos.stride(-1) == 1 and sin.stride() == cos.stride(), "cos/sin: q's dtype, rows"
    assert k_cache.shape[1:] == (Hk, D) and v_cache.shape == k_cache.shape, (
        f"cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not fit k {tuple(k.shape)}"
    )
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == q.dtype, (
        f"q {q.dtype}, k {k.dtype}, v {v.dtype} and cache {k_cache.dtype} {v_cache.dtype} must agree"
    )
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "cache: head_dim contiguous, k/v alike"
    assert slot_mapping.shape == (T,) and not slot_mapping.is_floating_point(), f"slot_mapping {slot_mapping.shape}"
    tl_dtype(q.dtype)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    slot_mapping = slot_mapping.contiguous()
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T and Hq + Hk:
        half = rd // 2
        rest = D - rd
        chain = pdl_chain(q.device)
        _rotary_kv_cache_kernel[(T, Hq + Hk)](
            q, k, v, out, k_cache, v_cache, cos, sin, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), cos.stride(0), Hq, half, D,
            ROT_BLOCK=triton.next_power_of_2(half), REST_BLOCK=triton.next_power_of_2(rest) if rest else 0,
            D_BLOCK=triton.next_power_of_2(D), PDL_CHAIN=chain, num_warps=_rotary_warps(delta, D), launch_pdl=chain,
            **row_delta.qkv_kernel_args(delta, q, Hk),
        )  # fmt: skip
    return out
