"""Paged attention on the GPU (Triton): one launch for a whole varlen batch, prefill and decode alike.

A program owns one work item (a sequence and a block of its query tokens) for one KV head, and packs
the GQA group into the rows of its tile: row r is query token r // G, q head kv_head * G + r % G, so
K and V of the head are read once for the whole group. It walks the sequence's KV through its block
table in BLOCK_N steps, only up to the causal limit of its last query token (and from the sliding
window's start, when the layer has one), with an online softmax in fp32.

Decode (every sequence has one new token) needs no work list: item i is sequence i.

Isolation: a program reads only its sequence's positions below its context length, through the entries
of its own block table that cover them: the block-table, K and V loads are masked past ``last``
(<= context length) with ``other=0``, so neither another sequence's KV, the table's padding, nor the
stale rest of a freed block ever reaches a register. Masking the scores alone would not do: a NaN V
times softmax weight 0 is NaN. Inside a sequence, its own keys past a row's causal limit (the rest of
the chunk) are masked on the scores only: they belong to that sequence.

o's LoRA shrink (decode, ``shrink``; opt-in, ``LORASERVE_ATTN_SHRINK=1``: measured slower, see SHRINK_ENABLED): the output is x
of o_proj, so a decode launch may also compute o's shrink of it (``_o_shrink``), as the norms do for qkv and
gate/up (``norm_shrink``): o's GEMM then runs without a shrink launch between attention and it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraserve.forward_context import AttentionMetadata
from loraserve.lora.ops.triton.l2_prefetch import prefetch_token_slot
from loraserve.lora.ops.triton.utils import dot_in, pdl_chain, pdl_link

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["window"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    seq_info_ptr,  # int32 (B, >=3): query_start, query_len, context_len
    block_table_ptr,  # int32 (B, max_blocks), row stride = stride_info (same packed tensor) or its own
    work_ptr,  # int32 (W, 2): sequence, query block (prefill only)
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (keys with pos - key_pos < window), used when SLIDING
    stride_info,
    stride_bt,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens)
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_DECODE: tl.constexpr,
    SLIDING: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: true fp32 products (no tf32), as the reference
    PDL_CHAIN: tl.constexpr,  # a link of the step's PDL chain (utils.pdl_chain)
    # o's LoRA shrink of the output (decode, ``SHRINK``): o's A, its ranks, each token's slot, and the partials,
    # one plane per KV head (summed by o's GEMM as split-K planes)
    oa_ptr,  # (S, 1, R, Hq * HEAD_DIM)
    orank_ptr,  # (S,) int32
    slots_ptr,  # (T,) int: each token's slot, -1 = base
    obuf_ptr,  # (Hk, 1, T, R) fp32
    n_tokens,
    stride_oas,
    SHRINK: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    G_POW2: tl.constexpr,
    # LoRA weights of the layer's next launches pulled into L2 for each token's slot (decode, ``l2_prefetch``):
    # the region table, its rows, and the tokens' slots (slots_ptr, n_tokens)
    pf_table_ptr,
    pf_regions,
    PREFETCH: tl.constexpr,
    PF_BLOCK_T: tl.constexpr,
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
    # weights and the mapping (written before the forward): before the wait, while the launch before runs
    if PREFETCH:
        prefetch_token_slot(pf_table_ptr, pf_regions, slots_ptr, tl.load(seq_info_ptr + item * stride_info), n_tokens,
                            kvh, tl.num_programs(1), PF_BLOCK_T)  # fmt: skip
    if SHRINK:  # before the wait: the metadata, the mapping and o's A (written before the forward)
        tok = tl.load(seq_info_ptr + item * stride_info)  # decode: item is the sequence, its one token
        oslot = tl.load(slots_ptr + tok)
        oa = _o_a_tile(oa_ptr, orank_ptr, oslot, kvh, stride_oas, G, HEAD_DIM, BLOCK_D, BLOCK_R, G_POW2)
    if PDL_CHAIN:  # touches the activations only after its wait
        pdl_link(True)
    if IS_DECODE:
        seq = item
        qb = 0
    else:
        seq = tl.load(work_ptr + 2 * item)
        qb = tl.load(work_ptr + 2 * item + 1)
    q_start = tl.load(seq_info_ptr + seq * stride_info)
    q_len = tl.load(seq_info_ptr + seq * stride_info + 1)
    ctx = tl.load(seq_info_ptr + seq * stride_info + 2)
    q0 = qb * BLOCK_Q
    if q0 >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    tq = q0 + rows // G  # query token within the sequence
    head = kvh * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (tq < q_len)
    pos = ctx - q_len + tq  # absolute position of each row's token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    t_idx = (q_start + tq).to(tl.int64)
    q = tl.load(
        q_ptr + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)

    last = tl.minimum(ctx - q_len + q0 + BLOCK_Q, ctx)  # one past the last key any row may see
    lo = 0
    if SLIDING:
        first_pos = ctx - q_len + q0
        lo = tl.maximum(first_pos - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, last, BLOCK_N):
        j = start + offs_n
        # NOTE: every load below is masked by j_ok with other=0 (never read, not just weighted 0): the
        # tile's tail past ``last`` would be another sequence's block (table padding) or a freed block's
        # stale KV, and a NaN there would survive p = 0 in the p @ v product
        j_ok = j < last
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
        ok = j_ok[None, :] & (j[None, :] <= pos[:, None])
        if SLIDING:
            ok = ok & (pos[:, None] - j[None, :] < window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
        )
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(
        o_ptr + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    if SHRINK:  # decode: one token (q_start), rows 0 .. G-1 its q heads kvh * G + g
        _o_shrink(out, oa, rows, oslot, q_start, kvh, obuf_ptr, n_tokens, R, BLOCK_R, G_POW2)


@triton.jit
def _o_a_tile(oa_ptr, orank_ptr, slot, kvh, stride_oas, G: tl.constexpr, HEAD_DIM: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, G_POW2: tl.constexpr):  # fmt: skip
    """(G_POW2 * BLOCK_R, BLOCK_D) of o's A for this program's q heads: row c is head kvh * G + c // BLOCK_R,
    rank c % BLOCK_R; zeros past the slot's rank (whatever A holds there), past G, and for a base token."""
    offs_c = tl.arange(0, G_POW2 * BLOCK_R)
    g = offs_c // BLOCK_R
    r = offs_c % BLOCK_R
    offs_d = tl.arange(0, BLOCK_D)
    rank = tl.load(orank_ptr + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    n_cols = tl.num_programs(1) * G * HEAD_DIM  # A's row: every q head's columns
    ptrs = oa_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_oas + r[:, None] * n_cols
    ptrs = ptrs + (kvh * G + g)[:, None] * HEAD_DIM + offs_d[None, :]
    return tl.load(ptrs, mask=((g < G) & (r < rank))[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _o_shrink(out, oa, rows, slot, t, kvh, obuf_ptr, n_tokens, R: tl.constexpr, BLOCK_R: tl.constexpr,
              G_POW2: tl.constexpr):  # fmt: skip
    """obuf[kvh, 0, t, r] = sum over this program's q heads g and head_dim d of A[slot(t), r, head g's d] *
    out[g, d]: this KV head's plane of o's shrink, for a token with a slot (base tokens' rows are read by no
    one: ``zero_fill``'s contract). o's GEMM sums the Hk planes in order (as split-K planes).

    One MMA (out, rounded as stored, by every head's tile of A: exact tf32 products of half-precision
    values, fp32 sums) gives every (row, head, rank); each row keeps its own head's columns."""
    if slot >= 0:
        m = dot_in(out, tl.trans(oa), tl.float32, False)  # (BLOCK_M, G_POW2 * BLOCK_R)
        offs_c = tl.arange(0, G_POW2 * BLOCK_R)
        own = rows[:, None] == (offs_c // BLOCK_R)[None, :]  # row g is head g of the token
        per_head = tl.sum(tl.where(own, m, 0.0), axis=0)
        part = tl.sum(tl.reshape(per_head, (G_POW2, BLOCK_R)), axis=0)
        offs_r = tl.arange(0, BLOCK_R)
        tl.store(obuf_ptr + (kvh * n_tokens + t) * R + offs_r, part, mask=offs_r < R)


def _tiles(group: int, decode: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of a tile and query tokens per tile for a GQA group size."""
    block_m = max(16, triton.next_power_of_2(group)) if decode else max(64, triton.next_power_of_2(group))
    return block_m, max(1, block_m // group)


def work_items(md: AttentionMetadata, block_q: int, device: torch.device) -> torch.Tensor:
    """(W, 2) int32 (sequence, query block) for a prefill/mixed batch, built once per forward and block_q."""
    key = ("work", block_q)
    if key not in md.gpu_cache:
        items = [(i, b) for i, n in enumerate(md.query_lens) for b in range(triton.cdiv(n, block_q))]
        md.gpu_cache[key] = torch.tensor(items, dtype=torch.int32).reshape(-1, 2).to(device)
    return md.gpu_cache[key]


def shrink_supports(q: torch.Tensor, kv_heads: int, md: AttentionMetadata, lora_a: torch.Tensor) -> bool:
    """Whether ``paged_attention`` can compute the shrink of its output with o's A stack (S, 1, R, Hq * D):
    a decode step (one query token a sequence), half-precision q and A (products exact in tf32), A
    contiguous, a program's tile of A (its group's q heads x the rank x head_dim, in powers of two; held in
    registers from before the PDL wait) at most MAX_SHRINK_TILE elements."""
    T, Hq, D = q.shape
    S, one, R, K = lora_a.shape
    group = triton.next_power_of_2(Hq // kv_heads)
    tile = group * max(16, triton.next_power_of_2(R)) * triton.next_power_of_2(D)
    return (
        md.max_query_len <= 1
        and q.dtype in (torch.float16, torch.bfloat16)
        and lora_a.dtype in (torch.float16, torch.bfloat16)
        and one == 1
        and K == Hq * D
        and tile <= MAX_SHRINK_TILE
        and lora_a.is_contiguous()
    )


# The decode attention computes o's LoRA shrink of its output (``shrink``): opt-in, LORASERVE_ATTN_SHRINK=1. Its first
# form measured slower (session 21, H100, Qwen2.5-0.5B, 32 tokens, 8 adapters, with down's in SiLU-and-mul: this kernel
# 6.5 -> 12.9 µs a launch, more than the 5.0 µs shrink launch it saved: A loaded after the KV loop, one cross-warp
# reduction of the output tile per q head, and the KV heads' planes summed by the token's last program behind an
# arrival counter). This form loads A before the PDL wait, takes one MMA and leaves the planes to o's GEMM: measured
# (session 22, same shape) 6.58 -> 8.43 µs a launch, saving the 4.96 µs shrink launch, and the step no faster (graph
# replay 1.39 ms both ways; with o's delta left to the norm, row_delta, 1.34 both ways): the saved launch overlapped.
SHRINK_ENABLED = os.environ.get("LORASERVE_ATTN_SHRINK", "0") == "1"
# A's tile a program holds: Qwen2.5-0.5B (a group of 7 q heads of 64) and Llama-8B (4 of 128) at rank 16 take 8192
MAX_SHRINK_TILE = 8192


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    block_size: int | None = None,
    shrink: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    prefetch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q (T, Hq, D) over the paged cache (num_slots, Hk, D) -> (T, Hq, D), causal (+ sliding window).

    Needs ``md.seq_info`` (B, >=3) int32 [query_start, query_len, context_len] and ``md.block_tables``
    (B, max_blocks) int32 on q's device.

    ``shrink``: (A (S, 1, R, Hq * D), ranks (S,) int32, token_slots (T,)) of o's LoRA (``shrink_supports``):
    then (out, obuf), obuf (Hk, 1, T, R) fp32: per KV head, that head's q heads' part of out.reshape(T, -1) @
    A[slot]^T per token with a slot; summed over the planes in order, what ``lora_shrink(..., zero_fill=True)``
    writes (every column r < R of those rows; base rows unwritten): the split-K planes decode_linear's
    epilogue sums (``ExpandEpilogue``).

    ``prefetch``: (a region table of LoRA stacks, ``l2_prefetch.region_table``; token_slots (T,)): on a decode
    step each program first asks L2 for its share of the lines of its token's slot in those stacks (the
    weights the layer's next launches read). The output is the same.
    """
    T, Hq, D = q.shape
    _, Hk, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape and Hq % Hk == 0, "q/k/v heads or head_dim disagree"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1, (
        "head_dim must be contiguous"
    )
    assert k_cache.dtype == v_cache.dtype == q.dtype, f"q {q.dtype} and cache {k_cache.dtype} differ"
    si, bt = md.seq_info, md.block_tables
    assert si is not None and bt is not None, "GPU attention needs seq_info and block_tables in the metadata"
    assert si.dtype == bt.dtype == torch.int32 and si.device == bt.device == q.device
    assert si.stride(1) == 1 and bt.stride(1) == 1
    block_size = block_size or md.block_size
    out = torch.empty_like(q)
    B = md.num_seqs
    if shrink is not None:
        oa, orank, slots = shrink
        assert shrink_supports(q, Hk, md, oa), f"o's A {tuple(oa.shape)} {oa.dtype}: see shrink_supports"
        R = oa.shape[2]
        obuf = torch.empty((Hk, 1, T, R), dtype=torch.float32, device=q.device)
    if T == 0 or B == 0:
        return out if shrink is None else (out, obuf)
    G = Hq // Hk
    decode = md.max_query_len <= 1
    block_m, block_q = _tiles(G, decode)
    if decode:
        work, n_items = si, B  # unused by the kernel
    else:
        work = work_items(md, block_q, q.device)
        n_items = work.shape[0]
    block_d = triton.next_power_of_2(D)
    block_n = 64 if block_d <= 128 and q.dtype != torch.float32 else 32
    chain = pdl_chain(q.device)
    if shrink is not None:
        assert decode and slots.shape == (T,) and orank.dtype == torch.int32, (
            "shrink: a decode step's slots, int32 ranks"
        )
        shrink_kw = dict(oa_ptr=oa, orank_ptr=orank, slots_ptr=slots, obuf_ptr=obuf, n_tokens=T,
                         stride_oas=oa.stride(0), SHRINK=True, R=R, BLOCK_R=max(16, triton.next_power_of_2(R)),
                         G_POW2=triton.next_power_of_2(G))  # fmt: skip
    else:
        shrink_kw = dict(oa_ptr=out, orank_ptr=si, slots_ptr=si, obuf_ptr=out, n_tokens=T, stride_oas=0,
                         SHRINK=False, R=16, BLOCK_R=16, G_POW2=1)  # fmt: skip
    pf_kw = dict(pf_table_ptr=si, pf_regions=0, PREFETCH=False, PF_BLOCK_T=1)
    if prefetch is not None and decode:
        table, slots = prefetch
        assert slots.shape == (T,), f"prefetch: the step's token slots (T,), not {tuple(slots.shape)}"
        assert table.dtype == torch.int64 and table.shape[1:] == (3,), "prefetch: an l2_prefetch.region_table"
        pf_kw = dict(
            pf_table_ptr=table, pf_regions=table.shape[0], PREFETCH=True, PF_BLOCK_T=triton.next_power_of_2(T)
        )
        if shrink is None:  # one slots_ptr serves both (the shrink's are the step's too)
            shrink_kw["slots_ptr"] = slots
    _paged_attention_kernel[(n_items, Hk)](
        q, k_cache, v_cache, out, si, bt, work,
        scale * _LOG2E, sliding_window or 0,
        si.stride(0), bt.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        G=G, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=block_d, IS_DECODE=decode, SLIDING=sliding_window is not None, IEEE=q.dtype == torch.float32,
        PDL_CHAIN=chain, num_warps=4, num_stages=2, launch_pdl=chain, **shrink_kw, **pf_kw,
    )  # fmt: skip
    return out if shrink is None else (out, obuf)
