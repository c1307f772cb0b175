"""The layout of ``delta_in_k`` (gate/up's LoRA delta as more K of its GEMM): the widened weight and its base
view, each slot's B in its columns for each slice's rows, and the product it stands for: each slice's rows
times [x | that slice's s] = x W^T + s_i B_i^T per token. Pure torch (the kernels: tests/gpu/test_delta_in_k.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loraserve.lora.ops import delta_in_k


def test_widen_keeps_the_base_weight_as_a_view():
    layer = nn.Linear(12, 10, bias=False)
    w = layer.weight.detach().clone()
    b = (torch.zeros(3, 1, 4, 2), torch.zeros(3, 1, 6, 2))  # 2 slices (4 + 6 rows), 3 slots, rank 2
    wide = delta_in_k.widen(layer, b)
    assert wide.shape == (10, 12 + 3 * 2)
    assert torch.equal(layer.weight, w) and layer.weight.data_ptr() == wide.data_ptr()
    assert layer.weight.stride() == (18, 1) and torch.equal(wide[:, 12:], torch.zeros(10, 6))
    assert delta_in_k.gemm_args(12, b) == (12, 4, 6)


def test_the_wide_product_is_the_base_plus_each_tokens_delta():
    g = torch.Generator().manual_seed(0)
    K, rows, S, R = 16, (8, 8), 4, 3
    layer = nn.Linear(K, sum(rows), bias=False)
    A = [torch.randn(S, 1, R, K, generator=g) for _ in rows]
    B = tuple(torch.randn(S, 1, n, R, generator=g) for n in rows)
    wide = delta_in_k.widen(layer, B)
    for slot in range(S):
        delta_in_k.write_slot(wide, K, B, slot)
    delta_in_k.write_slot(wide, K, tuple(torch.zeros_like(b) for b in B), 2)  # slot 2 reset: no delta
    slots = [0, 1, 2, 3, -1, 1]
    x = torch.randn(len(slots), K, generator=g)
    x_wide = torch.zeros(len(slots), K + len(rows) * S * R)
    x_wide[:, :K] = x
    for t, s in enumerate(slots):
        for i in range(len(rows)):
            if s >= 0:  # what the norm writes: the token's s_i in its slot's columns of slice i's set
                x_wide[t, K + (i * S + s) * R : K + (i * S + s + 1) * R] = A[i][s, 0] @ x[t]
    got = delta_in_k.reference(x_wide, wide, K, B)
    for t, s in enumerate(slots):
        want = layer.weight @ x[t]
        if s >= 0 and s != 2:
            want = want + torch.cat([B[i][s, 0] @ (A[i][s, 0] @ x[t]) for i in range(len(rows))])
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_it_fits_only_the_shapes_its_gemm_takes():
    b = lambda n, S=8, R=16: torch.zeros(S, 1, n, R)  # noqa: E731
    assert delta_in_k.fits(torch.zeros(2 * 4864, 896, dtype=torch.bfloat16), (b(4864), b(4864))), "Qwen2.5-0.5B's gate/up"
    assert not delta_in_k.fits(torch.zeros(2 * 1536, 576, dtype=torch.bfloat16), (b(1536), b(1536))), (
        "SmolLM2-135M's K 576: not a multiple of the GEMM's K step, the second slice's columns would start inside one"
    )
    assert not delta_in_k.fits(torch.zeros(2 * 96, 128, dtype=torch.bfloat16), (b(96), b(96))), "a block across slices"
    assert not delta_in_k.fits(torch.zeros(256, 128), (b(128), b(128))), "fp32: no half-precision decode GEMM"
    assert not delta_in_k.fits(torch.zeros(2 * 8192, 2048, dtype=torch.bfloat16), (b(8192), b(8192))), "past MAX_K"
    assert not delta_in_k.fits(torch.zeros(384, 128, dtype=torch.bfloat16), (b(128), b(128), b(128))), "3 slices"


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: ``applies``' other conditions without a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_applies_only_on_the_gpu_at_one_rank_and_not_fully_sharded():
    w = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = (torch.zeros(2, 1, 128, 2), torch.zeros(2, 1, 128, 2))
    assert delta_in_k.fits(w, b)
    assert not delta_in_k.applies(w, b, 1, False), "the CPU: no fused decode path"
    on_gpu = w.as_subclass(_OnCuda)
    assert delta_in_k.applies(on_gpu, b, 1, False)
    assert not delta_in_k.applies(on_gpu, b, 2, False), "tensor parallel"
    assert not delta_in_k.applies(on_gpu, b, 1, True), "the fully sharded wrappers (their own set_lora)"


def test_a_b_past_the_weights_range_is_refused_before_anything_is_written():
    """Every token's product reads every slot's columns: a B that overflows W's dtype would reach them all. The layer
    refuses it in set_lora (on the adapter's own tensors: no device sync in the engine's loads), before writing."""
    from loraserve.config import LoRAConfig
    from loraserve.layers.linear import MergedColumnParallelLinear
    from loraserve.lora.layers import MergedColumnParallelLinearWithLoRA

    base = MergedColumnParallelLinear(128, [128, 128], params_dtype=torch.float16)
    layer = MergedColumnParallelLinearWithLoRA(base)
    layer.create_lora_weights(2, LoRAConfig(max_loras=2, max_lora_rank=4, lora_dtype=torch.float32))
    assert layer.w_in_k is None, "the CPU: no fused decode path"
    layer.w_in_k = delta_in_k.widen(base, layer.lora_b_stacked)  # as create_lora_weights does on the GPU
    a = [torch.ones(4, 128), torch.ones(4, 128)]
    with pytest.raises(ValueError, match="slot 1: a LoRA B value is past torch.float16's range.*--dtype bfloat16"):
        layer.set_lora(1, a, [torch.full((128, 4), 1e6), torch.zeros(128, 4)])
    assert all(t.abs().sum() == 0 for t in (*layer.lora_a_stacked, *layer.lora_b_stacked)), "nothing written"
    assert torch.equal(layer.w_in_k[:, 128:], torch.zeros(256, 8, dtype=torch.float16))
    layer.set_lora(1, a, [torch.full((128, 4), 2.0), torch.zeros(128, 4)])
    assert torch.equal(layer.w_in_k[:128, 128 + 4 : 128 + 8], torch.full((128, 4), 2.0, dtype=torch.float16))
    with pytest.raises(ValueError, match="not finite"):
        delta_in_k.refuse_past_range([None, torch.tensor([[float("nan")]])], torch.float16, torch.bfloat16, 0)


def test_more_slot_columns_than_measured_are_not_taken():
    """The GEMM reads every slot's columns whatever ranks a step uses: past MAX_SLOT_COLUMNS (8 x 16, what was
    measured faster) the gated SiLU-and-mul keeps gate/up's delta."""
    w = torch.zeros(2 * 4864, 896, dtype=torch.bfloat16)
    b = lambda S, R: (torch.zeros(S, 1, 4864, R), torch.zeros(S, 1, 4864, R))  # noqa: E731
    assert delta_in_k.fits(w, b(8, 16)) and delta_in_k.fits(w, b(4, 32))
    assert not delta_in_k.fits(w, b(4, 64)), "the engine's default max_loras 4 x max_lora_rank 64: 256 columns"
    assert not delta_in_k.fits(w, b(16, 16))
