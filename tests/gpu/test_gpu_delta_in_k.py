"""gate/up's LoRA delta as more K of its GEMM (``delta_in_k``) on the kernels: ``decode_linear(in_k=...)`` (the
second slice's rows reading x's columns past K a slot set further on) against the torch product of the layout,
with and without split-K; and the norm writing the shrink into its output's columns, then that GEMM, against
the default path (the norm's fp32 shrink and the GEMM's epilogue) within the roundings of s and B.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (fp16 there: the interpreter's bf16 dots are wrong).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.gpu.test_decode_linear import lora_stacks, mapping_of, rel_err
from tests.gpu.triton_device import triton_device

DEV = triton_device()

from loraserve.layers import triton_decode_linear as dl  # noqa: E402
from loraserve.lora.ops import delta_in_k  # noqa: E402
from loraserve.lora.ops.triton import norm_shrink as ns  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402

DTYPE = torch.bfloat16 if DEV.type == "cuda" else torch.float16

CASES = [
    # M, K, rows a slice, S, R, tiles (None: the default ones)
    (32, 896, 256, 8, 16, None),  # Qwen2.5-0.5B's K, 8 slots of rank 16
    (5, 256, 128, 3, 32, dl.DecodeTiles(64, 128, 4, 3, split_k=2)),  # split-K: the second split starts in the sets
    (9, 512, 64, 2, 16, dl.DecodeTiles(64, 128, 4, 3, split_k=4)),  # the last split holds only the sets
    (5, 256, 64, 8, 32, dl.DecodeTiles(64, 128, 4, 3, split_k=4)),  # a split that starts past the base K
]


def wide_case(M, K, n, S, R, seed):
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(K, 2 * n, bias=False).to(DEV, DTYPE)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2 * n, K, generator=g) * 0.05)
    _, B = lora_stacks(g, S, R, K, (n, n), [R] * S, torch.float16)
    wide = delta_in_k.widen(layer, B)
    for j in range(S):
        delta_in_k.write_slot(wide, K, B, j)
    return g, layer, B, wide


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-N{2 * c[2]}-S{c[3]}-R{c[4]}-{c[5]}")
def test_the_gemm_reads_each_slices_set_of_columns(case):
    M, K, n, S, R, tiles = case
    g, layer, B, wide = wide_case(M, K, n, S, R, seed=M + K)
    x_wide = (torch.randn(M, K + 2 * S * R, generator=g) * 0.5).to(DEV, DTYPE)
    y = dl.decode_linear(x_wide, wide, tiles=tiles, in_k=delta_in_k.gemm_args(K, B))
    want = delta_in_k.reference(x_wide, wide, K, B)
    assert rel_err(y, want) < 5e-3
    # the base GEMM on the view of W's first K columns: the plain product
    base = dl.decode_linear(x_wide[:, :K].contiguous(), layer.weight, tiles=tiles)
    assert rel_err(base, x_wide[:, :K].float() @ layer.weight.float().T) < 5e-3


def test_norm_then_gemm_gives_the_projection_with_its_delta():
    """x_aug from ``norm_shrink(in_k=True)`` through ``decode_linear(in_k=...)`` equals the default path's
    (``norm_shrink``'s fp32 shrink into the GEMM's epilogue) within the roundings of s and B to x's dtype."""
    M, K, n, S, R = 32, 896, 256, 8, 16
    g, layer, B, wide = wide_case(M, K, n, S, R, seed=3)
    A, _ = lora_stacks(g, S, R, K, (n, n), [R] * S, torch.float16)
    x = torch.randn(M, K, generator=g).to(DEV, DTYPE)
    res = torch.randn(M, K, generator=g).to(DEV, DTYPE)
    w = (1 + 0.3 * torch.randn(K, generator=g)).to(DEV, DTYPE)
    slots = [-1 if t % 5 == 4 else t % S for t in range(M)]
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    rank_dev = ops.ranks_tensor([R] * S)
    out, _, buf = ns.norm_shrink(x, res, w, 1e-6, A, mapping.token_slots, rank_dev)
    want = ops.linear_with_lora(out, layer.weight, None, A, B, [R] * S, meta, mapping.token_slots, shrunk=buf)
    assert want is not None
    out_k, _, x_aug = ns.norm_shrink(x, res, w, 1e-6, A, mapping.token_slots, rank_dev, in_k=True)
    assert torch.equal(out_k, out)
    got = dl.decode_linear(x_aug, wide, in_k=delta_in_k.gemm_args(K, B))
    base = out.float() @ layer.weight.float().T
    assert rel_err(got - base, want.float() - base) < 2e-2, "the delta, within s's and B's roundings"
    assert rel_err(got, want) < 5e-3
