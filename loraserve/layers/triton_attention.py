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

NOTE: o's LoRA shrink computed by this launch (its output is o_proj's x, as the norms compute qkv's and gate/up's)
was measured no faster: the shrink launch it saves already overlaps the attention under PDL, and holding o's A
in registers from before the wait slowed the attention itself. It was removed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.forward_context import AttentionMetadata
from loraserve.lora.ops.triton.utils import pdl_chain, pdl_link

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
):
    item = tl.program_id(0)
    kvh = tl.program_id(1)
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


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    block_size: int | None = None,
) -> torch.Tensor:
    """q (T, Hq, D) over the paged cache (num_slots, Hk, D) -> (T, Hq, D), causal (+ sliding window).

    Needs ``md.seq_info`` (B, >=3) int32 [query_start, query_len, context_len] and ``md.block_tables``
    (B, max_blocks) int32 on q's device.
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
    if T == 0 or B == 0:
        return out
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
    _paged_attention_kernel[(n_items, Hk)](
        q, k_cache, v_cache, out, si, bt, work,
        scale * _LOG2E, sliding_window or 0,
        si.stride(0), bt.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        G=G, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=block_d, IS_DECODE=decode, SLIDING=sliding_window is not None, IEEE=q.dtype == torch.float32,
        PDL_CHAIN=chain, num_warps=4, num_stages=2, launch_pdl=chain,
    )  # fmt: skip
    return out
