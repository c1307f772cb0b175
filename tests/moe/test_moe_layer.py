"""The FusedMoE base layer against transformers' MoE blocks (5.24, eager experts) on random inputs.

Every family's router (Qwen3-MoE / Qwen2-MoE / OLMoE: weights cast to the model dtype, renormalized per
``norm_topk_prob``; Mixtral: always renormalized, fp32 weights), Qwen2-MoE's gated shared expert, top-k
ties, bf16 (where the router dtypes differ), the checkpoint layouts (fused 3-D, per-expert 2-D,
interleaved), non-gated experts and the TP shard rule (two ranks' partial sums = the whole).
"""

from __future__ import annotations

import pytest
import torch
from moe_fixtures import INTER, TOP_K, E, H, moe_config

from loraserve.distributed import parallel_state
from loraserve.layers.moe import FusedMoE, RoutingConfig, map_expert_checkpoint_name
from loraserve.models.mixtral import mixtral_block, olmoe_block
from loraserve.models.qwen_moe import qwen_moe_block

HF_BLOCKS = {
    "qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    "qwen2_moe": "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "mixtral": "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "olmoe": "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
}
OURS = {
    "qwen3_moe": qwen_moe_block,
    "qwen2_moe": qwen_moe_block,
    "mixtral": mixtral_block,
    "olmoe": olmoe_block,
}
CASES = [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False), ("qwen2_moe", True), ("mixtral", None),
         ("olmoe", False), ("olmoe", True)]  # fmt: skip


def hf_block(arch: str, norm_topk_prob: bool | None, seed: int, dtype=torch.float32):
    kw = {} if norm_topk_prob is None else {"norm_topk_prob": norm_topk_prob}
    cfg = moe_config(arch, experts_implementation="eager", **kw)
    mod, cls = HF_BLOCKS[arch].rsplit(".", 1)
    block = getattr(__import__(f"transformers.models.{mod}", fromlist=[cls]), cls)(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return cfg, block.to(dtype).eval()


def ours_from(arch: str, cfg, hf, dtype=torch.float32):
    """Our block with HF's weights, loaded through the weight_loaders (the fused 3-D layout)."""
    block = OURS[arch](cfg).to(dtype)
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(block.experts, name)
            p.weight_loader(p, getattr(hf.experts, name).data)
        if block.shared_expert is not None:
            gu = block.shared_expert.gate_up_proj
            gu.weight_loader(gu.weight, hf.shared_expert.gate_proj.weight, 0)
            gu.weight_loader(gu.weight, hf.shared_expert.up_proj.weight, 1)
            block.shared_expert.down_proj.weight.copy_(hf.shared_expert.down_proj.weight)
            block.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
    return block


@pytest.mark.parametrize("arch,norm", CASES, ids=[f"{a}-norm{n}" for a, n in CASES])
def test_block_matches_hf(arch, norm):
    cfg, hf = hf_block(arch, norm, seed=len(arch) + bool(norm))
    ours = ours_from(arch, cfg, hf)
    assert hasattr(hf, "shared_expert") == (ours.shared_expert is not None) == (arch == "qwen2_moe")
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(x[None])[0]
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    # the two renormalization settings really give different answers
    if norm is not None:
        _, other = hf_block(arch, not norm, seed=len(arch) + bool(norm))
        with torch.no_grad():
            assert (other(x[None])[0] - want).abs().max() > 1e-3


@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("mixtral", None)])
def test_block_matches_hf_in_bf16(arch, norm):
    """bf16: Qwen rounds the top-k weights to bf16 before multiplying, Mixtral multiplies by fp32 weights."""
    cfg, hf = hf_block(arch, norm, seed=7, dtype=torch.bfloat16)
    ours = ours_from(arch, cfg, hf, torch.bfloat16)
    x = torch.randn(29, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        want = hf(x[None])[0]
        got = ours(x)
        assert torch.equal(got, want), (got - want).abs().max()
        # the other weight dtype rounds differently: the flag is what makes the match exact
        flipped = RoutingConfig(TOP_K, renormalize=True, weights_fp32=not ours.experts.routing.weights_fp32)
        ours.experts.routing = flipped
        assert not torch.equal(ours(x), want)


@pytest.mark.parametrize("norm", [False, True])
def test_topk_ties_break_as_hf(norm):
    """Router rows 0, 1, 2 equal: every token has a three-way tie at the top-k boundary."""
    cfg, hf = hf_block("qwen3_moe", norm, seed=11)
    with torch.no_grad():
        hf.gate.weight[1:3] = hf.gate.weight[0]
    ours = ours_from("qwen3_moe", cfg, hf)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = ours.gate(x)
        assert torch.equal(logits[:, 0], logits[:, 1]) and torch.equal(logits[:, 1], logits[:, 2])
        want = hf(x[None])[0]
        torch.testing.assert_close(ours(x), want, rtol=0, atol=2e-6)
        # another tie-break (0 -> 1 -> 2 -> 0 among the tied experts) gives another answer
        w, ids = ours.experts.select_experts(logits)
        alt = torch.where(ids < 3, (ids + 1) % 3, ids)
        assert (ours.experts.experts_forward(x, w, alt) - want).abs().max() > 1e-3


def _naive(
    moe: FusedMoE, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Token by token: sum_k w_k * W2_e act(W13_e x), w13 in the [gate; up] layout (or up only)."""
    probs = torch.softmax(logits.float(), -1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, ids = torch.topk(probs[t], moe.routing.top_k)
        w = w / w.sum() if moe.routing.renormalize else w
        for wk, e in zip(w, ids.tolist()):
            h = w13[e] @ x[t]
            a = moe.act(h[:INTER]) * h[INTER:] if moe.gated else moe.act(h)
            out[t] += wk * (w2[e] @ a)
    return out


def _moe(**kw) -> FusedMoE:
    m = FusedMoE(E, H, INTER, RoutingConfig(TOP_K, renormalize=True), **kw)
    torch.nn.init.normal_(m.gate_up_proj, std=0.2)
    torch.nn.init.normal_(m.down_proj, std=0.2)
    return m


def test_per_expert_and_fused_checkpoints_load_the_same():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)
    fused, split = _moe(), _moe()
    fused.gate_up_proj.weight_loader(fused.gate_up_proj, w13)
    fused.down_proj.weight_loader(fused.down_proj, w2)
    for e in range(E):  # through the loader's key mapping, Qwen names and Mixtral's v4 names
        for key, t in ((f"model.layers.0.mlp.experts.{e}.gate_proj.weight", w13[e, :INTER]),
                       (f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight", w13[e, INTER:]),
                       (f"model.layers.0.mlp.experts.{e}.down_proj.weight", w2[e])):  # fmt: skip
            target, args = map_expert_checkpoint_name(key)
            p = getattr(split, target.rpartition(".")[2])
            p.weight_loader(p, t, *args)
    assert torch.equal(fused.gate_up_proj, w13) and torch.equal(split.gate_up_proj, w13)
    assert torch.equal(split.down_proj, w2)
    assert map_expert_checkpoint_name("model.layers.3.block_sparse_moe.gate.weight") == (
        "model.layers.3.mlp.gate.weight",
        (),
    )
    assert map_expert_checkpoint_name("model.layers.3.mlp.experts.gate_up_proj") is None


def test_interleaved_and_non_gated_experts_match_a_naive_reference():
    g = torch.Generator().manual_seed(1)
    x, logits = torch.randn(23, H, generator=g), torch.randn(23, E, generator=g)
    concat = _moe()
    inter = _moe(interleaved=True)
    w13 = concat.gate_up_proj.data.clone()
    stored = torch.empty_like(w13)
    stored[:, 0::2], stored[:, 1::2] = w13[:, :INTER], w13[:, INTER:]  # GPT-OSS: g0, u0, g1, u1, ...
    inter.gate_up_proj.weight_loader(inter.gate_up_proj, stored)
    inter.down_proj.data.copy_(concat.down_proj)
    assert torch.equal(inter.gate_up_proj, stored)
    with torch.no_grad():
        want = _naive(concat, w13, concat.down_proj, x, logits)
        torch.testing.assert_close(concat(x, logits), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(inter(x, logits), want, rtol=0, atol=1e-5)
        relu = _moe(gated=False, activation="relu")
        assert relu.gate_up_proj.shape == (E, INTER, H)
        torch.testing.assert_close(
            relu(x, logits), _naive(relu, relu.gate_up_proj, relu.down_proj, x, logits), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("interleaved", [False, True])
def test_tensor_parallel_shards_sum_to_the_whole(interleaved):
    """Each rank holds INTER/2 of every expert (gate and up sliced on their own); the partial sums add up."""
    g = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2
    x, logits = torch.randn(19, H, generator=g), torch.randn(19, E, generator=g)

    def build():
        m = FusedMoE(
            E,
            H,
            INTER,
            RoutingConfig(TOP_K, renormalize=False),
            interleaved=interleaved,
            reduce_results=False,
        )
        m.gate_up_proj.weight_loader(m.gate_up_proj, w13)
        m.down_proj.weight_loader(m.down_proj, w2)
        return m

    whole = build()(x, logits)
    parts = []
    try:
        for rank in range(2):
            parallel_state.set_tp_state(rank, 2)
            m = build()
            assert m.gate_up_proj.shape == (E, INTER, H) and m.down_proj.shape == (E, H, INTER // 2)
            parts.append(m(x, logits))
    finally:
        parallel_state.reset()
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-5)
    assert (parts[0] - whole).abs().max() > 1e-2
