"""Tiny random MoE models (HF transformers 5 configs), saved on the fly, and shared helpers."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from helpers import VOCAB, make_tokenizer  # noqa: E402

H, INTER, E, TOP_K = 64, 24, 4, 2  # hidden != 2 * moe_intermediate, so shapes tell gate_up and down apart
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    eos_token_id=1,
    bos_token_id=None,
    pad_token_id=0,
    initializer_range=0.1,  # peaked logits: greedy has clear winners
)
MOE_ARCHS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, intermediate_size=40, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=E, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER, intermediate_size=40,
        shared_expert_intermediate_size=40)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=E, num_experts_per_tok=TOP_K, intermediate_size=INTER)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=E, num_experts_per_tok=TOP_K, intermediate_size=INTER)),
}  # fmt: skip


def moe_config(arch: str, **overrides):
    cfg_name, _, kw = MOE_ARCHS[arch]
    return getattr(transformers, cfg_name)(**{**COMMON, **kw, **overrides})


def perturb_(model: torch.nn.Module, seed: int) -> None:
    """Random norm weights and biases (HF sets them to constants), so they are exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def make_moe_model(path, arch: str, seed: int = 0, save_original_format: bool = True, **overrides):
    """Save a tiny random HF MoE model (fp32) plus tokenizer at path; return it (eval mode)."""
    cfg = moe_config(arch, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, MOE_ARCHS[arch][1])(cfg).eval()
    perturb_(model, seed + 1)
    model.save_pretrained(str(path), save_original_format=save_original_format)
    make_tokenizer(path, cfg.vocab_size)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            eos_token_id=None,
            max_new_tokens=n,
        )
    return out[0, len(prompt) :].tolist()
