"""The Triton MoE path (grouped GEMM + expert LoRA kernels) against the torch path, on random data.

The torch path (``FusedMoE.experts_forward`` and its per-(slot, expert) hook) is itself checked against
transformers + PEFT in tests/moe; here both run on the same device and inputs. Covers gated, interleaved
(GPT-OSS) and non-gated experts, Mixtral's fp32 routing weights, mixed batches (base tokens, slots with
LoRA on w13 and w2, on w2 only, a reset slot, heterogeneous ranks, garbage past each slot's rank that must
never be read), and a CUDA graph captured with no expert LoRA loaded that must apply it after a load.

Runs on CUDA (the device machine), or on the CPU under ``TRITON_INTERPRET=1`` with triton installed.
"""

from __future__ import annotations

import pytest
import torch
from gpu.triton_device import triton_device

DEV = triton_device()

from loraserve.config import LoRAConfig  # noqa: E402
from loraserve.forward_context import forward_context  # noqa: E402
from loraserve.layers.moe import FusedMoE, RoutingConfig  # noqa: E402
from loraserve.lora.layers.fused_moe import FusedMoEWithLoRA  # noqa: E402
from loraserve.lora.punica import LoRAMapping  # noqa: E402

LAYOUTS = ["gated", "interleaved", "non_gated"]
# NOTE: triton 3.6's interpreter computes bf16 loads/dots wrongly (garbage on a 16x16 dot): bf16 runs on CUDA only
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV.type == "cuda" else [])


def make_layer(E, H, inter, top_k, layout, dtype, seed, weights_fp32=False, max_loras=4, rank=8):
    base = FusedMoE(
        E, H, inter, RoutingConfig(top_k, renormalize=True, weights_fp32=weights_fp32),
        gated=layout != "non_gated", interleaved=layout == "interleaved", reduce_results=False,
        params_dtype=dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        base.gate_up_proj.copy_(torch.randn(base.gate_up_proj.shape, generator=g) * 0.1)
        base.down_proj.copy_(torch.randn(base.down_proj.shape, generator=g) * 0.1)
    base.to(DEV)
    layer = FusedMoEWithLoRA(base)
    layer.create_lora_weights(max_loras, LoRAConfig(max_loras=max_loras, max_lora_rank=rank, lora_dtype="float32"))
    return layer


def load_random_loras(layer, specs, seed):
    """specs[slot] = (rank, slices with LoRA) or None; garbage (1e4) past each rank."""
    g = torch.Generator().manual_seed(seed)
    E = layer.base_layer.num_experts
    for s, spec in enumerate(specs):
        if spec is None:
            continue
        r, which = spec
        a = [None] * layer.n_slices
        b = [None] * layer.n_slices
        for i in which:
            (fin, fout) = layer.full_shapes[i]
            a[i] = torch.randn(E, r, fin, generator=g) * 0.3
            b[i] = torch.randn(E, fout, r, generator=g) * 0.3
        layer.set_lora(s, a, b)
        R = layer.lora_a_stacked[0].shape[2]
        if r < R:
            for i in range(layer.n_slices):
                layer.lora_a_stacked[i][s, :, r:] = 1e4
                layer.lora_b_stacked[i][s, :, :, r:] = 1e4


def inputs(T, H, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    logits = torch.randn(T, E, generator=g).to(DEV, dtype)
    return x, logits


def assert_matches(got, want, dtype):
    """fp32: elementwise within 1e-4. bf16: max |got - want| / max |want| < 1e-2 (the issue's kernel
    criterion); elementwise bounds fail on a few outputs from the rounding order alone (seen: 2 of 2368
    off by 0.033 on the H200), a wrong delta moves the whole tensor."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
    else:
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert err < 1e-2, f"relative error {err:.2e}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
# NOTE: (600, 4, 2): 300 rows per expert, so 128-row blocks and the prefill tiles (shared memory in fp32)
@pytest.mark.parametrize("T,E,top_k", [(1, 4, 2), (7, 8, 2), (70, 16, 4), (600, 4, 2)])
def test_grouped_gemm_equals_torch_path(layout, dtype, T, E, top_k):
    layer = make_layer(E, 64, 48, top_k, layout, dtype, seed=T + E, weights_fp32=layout == "gated")
    base = layer.base_layer
    x, logits = inputs(T, 64, E, dtype, seed=1)
    base.backend = "torch"
    want = base(x, logits)
    base.backend = "triton"
    got = base(x, logits)
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_lora_kernels_equal_torch_path_in_a_mixed_batch(layout, dtype):
    E, H, inter, top_k, T = 8, 64, 48, 2, 37
    layer = make_layer(E, H, inter, top_k, layout, dtype, seed=3)
    n = layer.n_slices
    # slot 0: every slice rank 3; slot 1: w2 only, rank 8; slot 2: loaded then reset; slot 3: rank 5
    load_random_loras(layer, [(3, range(n)), (8, [n - 1]), (4, range(n)), (5, range(n))], seed=4)
    layer.reset_lora(2)
    x, logits = inputs(T, H, E, dtype, seed=5)
    slots = [(-1, 0, 1, 2, 3)[t % 5] for t in range(T)]
    mapping = LoRAMapping.build(slots, slots, torch.device("cpu"))
    mapping.token_slots = mapping.token_slots.to(DEV)
    base = layer.base_layer
    with forward_context(lora=mapping):
        base.backend = "torch"
        want = layer(x, logits)
        base.backend = "triton"
        got = layer(x, logits)
    assert_matches(got, want, dtype)
    base_only = base(x, logits)
    for s in (0, 3):  # base tokens and the reset slot take the base path
        torch.testing.assert_close(got[s::5], base_only[s::5], rtol=0, atol=0)
    assert (got[1::5] - base_only[1::5]).abs().max() > 1e-2  # the deltas are there


@pytest.mark.skipif(DEV.type != "cuda", reason="CUDA graphs")
def test_graph_captured_before_any_expert_lora_applies_it_after_a_load():
    """The SGLang #28371 failure, on experts: a graph captured while no slot has expert LoRA must add
    the deltas of an adapter loaded later (ranks and slots are data, refreshed before the replay)."""
    from loraserve.lora.punica import PunicaWrapper, SegmentMeta

    E, H, inter, top_k, T, S = 8, 64, 48, 2, 16, 4
    layer = make_layer(E, H, inter, top_k, "gated", torch.bfloat16, seed=6, max_loras=S)
    punica = PunicaWrapper(S, DEV)
    layer.set_mapping(punica)
    x, logits = inputs(T, H, E, torch.bfloat16, seed=7)
    slots = torch.tensor([t % S for t in range(T)], device=DEV)
    meta = SegmentMeta(torch.zeros(T + 3 * S, dtype=torch.int32, device=DEV), T, S, T, static=True)
    placeholder = [(0, slots[:0])]
    static = LoRAMapping(slots, slots, placeholder, placeholder, slots, [0], [0], meta, meta)
    with forward_context(lora=static):
        layer(x, logits)  # warm-up: compiles, creates the device rank copy
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        load_random_loras(layer, [(4, range(3)), None, (8, [2]), None], seed=8)
        punica.kernels.refresh_ranks()
        graph.replay()
        eager = layer(x, logits)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    base_only = layer.base_layer(x, logits)
    assert (out[0::4] - base_only[0::4]).abs().max() > 1e-2
    torch.testing.assert_close(out[1::4], base_only[1::4], rtol=0, atol=0)
