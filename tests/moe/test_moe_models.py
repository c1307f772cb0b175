"""MoE model parity with transformers on tiny random models (fp32, CPU).

Qwen3-MoE (with and without a dense ``mlp_only_layers`` layer), Qwen2-MoE (shared expert, qkv bias),
Mixtral (renormalized fp32 router) and OLMoE (full-width q/k norms): one batch of prompts of different
lengths through ``LLM.generate``; prompt logprobs and every decode logprob within 1e-4 of HF's
log-softmax, greedy ids equal to HF ``generate``. Checkpoints in both of transformers 5's layouts:
per-expert keys (what ``save_pretrained`` writes) and the fused 3-D ``experts.gate_up_proj``.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import hf_logprobs
from moe_fixtures import hf_greedy, make_moe_model
from safetensors import safe_open

from loraserve import LLM, SamplingParams

ATOL = 1e-4
MAX_TOKENS = 8
SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 3, 17, 250, 9, 9, 9, 60, 61, 62, 63, 64, 65]]

# name -> (arch, overrides, save_original_format)
CASES = {
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}, True),
    "qwen3_moe_dense_layer_fused_ckpt": ("qwen3_moe", {"mlp_only_layers": [0]}, False),
    "qwen2_moe": ("qwen2_moe", {}, True),
    "mixtral": ("mixtral", {}, True),
    "mixtral_fused_ckpt": ("mixtral", {}, False),
    "olmoe": ("olmoe", {"clip_qkv": 0.6}, True),
}


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory):
    arch, overrides, original = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_moe_model(path, arch, seed=len(request.param), save_original_format=original, **overrides)
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP)
    yield request.param, path, hf, outs
    del llm


def test_checkpoint_layout_is_as_named(run):
    name, path, _, _ = run
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    assert fused == name.endswith("fused_ckpt")
    if name == "mixtral":  # transformers 5 writes Mixtral's v4 names
        assert any(".block_sparse_moe.experts.0.w1.weight" in k for k in keys)
    if name.startswith("qwen3_moe_dense"):
        assert json.loads((path / "config.json").read_text())["mlp_only_layers"] == [0]
        assert any(k.startswith("model.layers.0.mlp.gate_proj") for k in keys)


def test_logprobs_and_greedy_match_hf(run):
    _, _, hf, outs = run
    for prompt, out in zip(PROMPTS, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(hf, prompt + gen)
        for i in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) <= ATOL
        assert len(gen) == MAX_TOKENS
        for j, tok in enumerate(gen):
            assert abs(out.outputs[0].logprobs[j][tok].logprob - ref[len(prompt) - 1 + j, tok].item()) <= ATOL
        assert gen == hf_greedy(hf, prompt, MAX_TOKENS)


def test_the_experts_matter(run):
    """Routing is not degenerate: the prompt uses >= 3 experts of the first MoE layer, and zeroing one of
    them changes HF's logits (so parity really covers the experts)."""
    _, _, hf, _ = run
    layer = next(m for m in hf.model.layers if hasattr(m.mlp, "experts"))
    x = torch.tensor([PROMPTS[2]])
    seen = {}
    handle = layer.mlp.gate.register_forward_hook(lambda m, a, out: seen.update(ids=out[2]))
    with torch.no_grad():
        before = hf(x).logits
        handle.remove()
        used = seen["ids"].unique().tolist()
        assert len(used) >= 3, used
        saved = layer.mlp.experts.down_proj.data.clone()
        layer.mlp.experts.down_proj.data[used[0]].zero_()
        after = hf(x).logits
        layer.mlp.experts.down_proj.data.copy_(saved)
    assert (before - after).abs().max() > 1e-3
