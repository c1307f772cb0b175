"""LoRA expand on the GPU: y[t, off_i + n] += sum_r buf[t, i, r] * B_i[slot(t), n, r], for 1-3 slices at once.

A program owns one BLOCK_N tile of one slice's outputs x one block of tokens of one segment. It sums
the planes of ``buf`` while loading them (``lora_shrink`` gives one), rounds them to the products' dtype
(``precision.compute_dtype``: B's, as the torch reference and PEFT do before the second matmul, or fp32
for fp32 B and for fp16 B with bf16 activations), multiplies, accumulates in fp32, and adds into ``y``:

- ``y`` fp32: the accumulator the layer rounds later.
- ``y`` bf16/fp16 (the layer's own output): the add runs in fp32 and each element is rounded once,
  which equals ``(y.float() + delta).to(y.dtype)`` without the two extra passes over y.

Each output element belongs to exactly one token, hence one slot and one program: no atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import compute_dtype_of, dot_in, sum_planes, tl_dtype, use_pdl
from loraserve.lora.punica import SegmentMeta


@triton.jit
def tile_slice(pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, N2, tiles0, tiles01,
               y_offset, NUM_SLICES: tl.constexpr):  # fmt: skip
    """(B, B's slot stride, slice, column tile within the slice, the slice's width, its first column of y)
    of column tile pid_n, the tiles of slice 0 first (tiles0 of them), then slice 1's (up to tiles01)."""
    # NOTE: `pid_n * 0 + c`: every branch of a runtime `if` must give a variable the same type
    w_ptr = b0_ptr
    stride_ws = stride_ws0
    sl = pid_n * 0
    n_tile = pid_n
    n_size = pid_n * 0 + N0
    col0 = pid_n * 0 + y_offset
    if NUM_SLICES > 1:
        if pid_n >= tiles0:
            if pid_n < tiles01:
                w_ptr = b1_ptr
                stride_ws = stride_ws1
                sl = pid_n * 0 + 1
                n_tile = pid_n - tiles0
                n_size = pid_n * 0 + N1
                col0 = pid_n * 0 + y_offset + N0
            else:
                w_ptr = b2_ptr
                stride_ws = stride_ws2
                sl = pid_n * 0 + 2
                n_tile = pid_n - tiles01
                n_size = pid_n * 0 + N2
                col0 = pid_n * 0 + y_offset + N0 + N1
    return w_ptr, stride_ws, sl, n_tile, n_size, col0


# NOTE: sizes (K, N, column offsets) are specialized, not do_not_specialize: Triton then knows they are
# multiples of 16 and vectorizes the masked loads along the contiguous axis; as runtime ints every
# masked load there went scalar. Specializing compiles once per divisibility class, not per value.
@triton.jit(do_not_specialize=["T", "S", "tiles0", "tiles01", "SPLIT_K"])
def _lora_expand_kernel(
    buf_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    meta_ptr,  # int32: order (T,), seg_slot (S,), seg_start (S,), seg_len (S,)
    rank_ptr,  # int32 (max_loras,)
    T,
    S,
    N0,
    N1,
    N2,
    tiles0,
    tiles01,
    y_offset,
    stride_bsp,
    stride_bi,
    stride_bm,
    stride_ws0,
    stride_ws1,
    stride_ws2,
    stride_wn,
    stride_wr,
    stride_ym,
    stride_yn,
    SPLIT_K,
    R,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RED: tl.constexpr,  # planes of buf loaded at once
    CDT: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    seg = tl.program_id(2)

    slot = tl.load(meta_ptr + T + seg)
    seg_start = tl.load(meta_ptr + T + S + seg)
    seg_len = tl.load(meta_ptr + T + 2 * S + seg)
    rank = tl.load(rank_ptr + slot)
    m0 = pid_m * BLOCK_M
    if (rank == 0) | (m0 >= seg_len):
        return

    w_ptr, stride_ws, sl, n_tile, n_size, col0 = tile_slice(
        pid_n, b0_ptr, b1_ptr, b2_ptr, stride_ws0, stride_ws1, stride_ws2, N0, N1, N2, tiles0, tiles01, y_offset,
        NUM_SLICES,
    )

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(meta_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)  # (BLOCK_M,)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_size

    # NOTE: B is read across all BLOCK_R columns, not masked by the slot's rank (a runtime value, which
    # would make the load scalar along r, B's contiguous axis): h is 0 past the rank, and B's columns
    # there are finite (the layers keep them zero), so they add nothing.
    w = tl.load(
        w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wn + offs_r[:, None] * stride_wr,
        mask=(offs_r < R)[:, None] & n_mask[None, :],
        other=0.0,
    )  # (BLOCK_R, BLOCK_N)
    if USE_PDL:
        # launched early (PDL): the mapping and B were written before this forward; buf (the shrink's)
        # and y are read only after the kernel before us has finished and flushed.
        # NOTE: y loaded before this wait (legal: the shrink lets us launch only after its own wait) was
        # measured no faster at 4096 tokens (H200: qkv 55.9 vs 56.5 µs, gate_up 164.8 vs
        # 164.6) and was removed
        tl.extra.cuda.gdc_wait()
    # (BLOCK_M, BLOCK_R): the shrink's partials, summed in fp32, then rounded to the products' dtype
    h_ptrs = buf_ptr + sl * stride_bi + tok[:, None] * stride_bm + offs_r[None, :]
    h_mask = m_mask[:, None] & r_mask[None, :]
    h = sum_planes(h_ptrs, h_mask, SPLIT_K, stride_bsp, RED, False).to(CDT)  # s in the products' dtype (precision.py)

    delta = dot_in(h, w, CDT, IEEE)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + (col0 + offs_n)[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    yv = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class PrefillTiles:
    """The launch of segments longer than 32 tokens (prefill): a program adds the delta of a
    (block_m tokens, block_n columns) tile. A knob: ``bench_lora_kernels.py --tune-prefill`` sweeps
    it at 4096 tokens.

    Defaults from that sweep (H200; 4096 tokens, 8 adapters, rank 16, bf16 / fp32 LoRA
    weights, µs alone): 32 x 128 on 4 warps, qkv 35.8 / 38.2, gate_up 138.9 / 149.4, against 64 x 64's
    39.1 / 39.0 and 151.2 / 153.3 (the least time summed over the four cases).
    """

    block_m: int = 32
    block_n: int = 128
    num_warps: int = 4


PREFILL = PrefillTiles()


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    lora_b: tuple[torch.Tensor, ...],
    meta: SegmentMeta,
    ranks: torch.Tensor,
    offset: int = 0,
    *,
    act_dtype: torch.dtype,
) -> None:
    """y (T, N) += per-slice B_i(buf_i) at columns offset + sum(N_<i); buf from ``lora_shrink``.

    B's columns at r >= a slot's rank must be finite (they multiply zeros; the layers keep them 0).

    ``act_dtype``: the layer's activation dtype (the x of the shrink), which with B's dtype picks the
    products' (``utils.compute_dtype_of``): fp32 B multiplies in true fp32 for fp32 activations and in tf32
    for half-precision ones; fp16 B with bf16 activations in tf32; B of the activations' dtype in it.
    """
    n = len(lora_b)
    assert 1 <= n <= 3, f"1 to 3 slices per launch, got {n}"
    assert y.dim() == 2, f"y must be 2-D (T, N), got {tuple(y.shape)}"
    T = y.shape[0]
    split, n_buf, T_buf, R = buf.shape
    assert buf.dtype == torch.float32 and n_buf == n and T_buf == T, f"buf {tuple(buf.shape)} does not fit"
    assert buf.stride(3) == 1 and buf.device == y.device
    b0 = lora_b[0]
    assert b0.dim() == 4 and b0.shape[1] == 1 and b0.shape[3] == R, (
        f"B {tuple(b0.shape)} does not fit rank {R}"
    )
    for b in lora_b:
        assert b.dtype == b0.dtype and b.shape[0] == b0.shape[0] and b.shape[3] == R, "slices differ"
        assert b.stride()[1:] == (b.shape[2] * R, R, 1) and b.device == y.device, (
            "B must be contiguous (out, R) per slot"
        )
    sizes = [b.shape[2] for b in lora_b] + [0] * (3 - n)
    assert offset + sum(sizes) <= y.shape[1], (
        f"slices {sizes[:n]} at offset {offset} overflow y {tuple(y.shape)}"
    )
    assert ranks.dtype == torch.int32 and ranks.numel() == b0.shape[0], "ranks: int32, one per slot"
    assert meta.num_tokens == T
    if meta.num_segs == 0 or T == 0:
        return
    longest = meta.max_seg_len
    prefill = longest > 32
    block_m = 16 if longest <= 16 else (32 if not prefill else PREFILL.block_m)
    block_n = PREFILL.block_n if prefill else 128
    launch = dict(num_warps=PREFILL.num_warps) if prefill else dict(num_warps=4)
    block_r = max(16, triton.next_power_of_2(R))
    tiles = [triton.cdiv(s, block_n) for s in sizes]
    cdt = compute_dtype_of(act_dtype, b0.dtype)
    b1 = lora_b[1] if n > 1 else b0
    b2 = lora_b[2] if n > 2 else b0
    grid = (sum(tiles), triton.cdiv(longest, block_m), meta.num_segs)
    pdl = use_pdl(y.device)
    _lora_expand_kernel[grid](
        buf, b0, b1, b2, y, meta.packed, ranks,
        T, meta.num_segs, sizes[0], sizes[1], sizes[2], tiles[0], tiles[0] + tiles[1], offset,
        buf.stride(0), buf.stride(1), buf.stride(2),
        b0.stride(0), b1.stride(0), b2.stride(0), R, 1,
        y.stride(0), y.stride(1), split, R,
        NUM_SLICES=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, RED=min(triton.next_power_of_2(split), 16),
        CDT=tl_dtype(cdt), IEEE=cdt == torch.float32 and act_dtype == torch.float32,
        USE_PDL=pdl, launch_pdl=pdl, **launch,
    )  # fmt: skip
