"""Qwen3-MoE and Qwen2-MoE: Llama-family attention (Qwen3's per-head q/k norms, Qwen2's qkv bias)
with sparse MoE MLPs from layers/moe.py.

- Qwen3-MoE: softmax top-k router, renormalized when ``norm_topk_prob``; dense ``LlamaMLP`` layers where
  ``mlp_only_layers`` / ``decoder_sparse_step`` say so, as HF's decoder layer decides.
- Qwen2-MoE: the same router and experts plus a shared expert scaled by sigmoid(``shared_expert_gate``).

Paths mirror HF's: ``model.layers.N.mlp.gate.weight``, ``mlp.experts.{gate_up_proj,down_proj}``,
``mlp.shared_expert.gate_up_proj`` (packs gate_proj/up_proj), ``mlp.shared_expert_gate``.
"""

from __future__ import annotations

from loraserve.layers.moe import FusedMoE, RoutingConfig, SparseMoeBlock, map_expert_checkpoint_name
from loraserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def is_moe_layer(config, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


def qwen_moe_block(config) -> SparseMoeBlock:
    experts = FusedMoE(
        config.num_experts,
        config.hidden_size,
        config.moe_intermediate_size,
        RoutingConfig(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob)),
        activation=config.hidden_act,
    )
    shared_size = getattr(config, "shared_expert_intermediate_size", None)
    shared = LlamaMLP(config, shared_size) if shared_size else None
    return SparseMoeBlock(experts, shared, shared_expert_gate=shared is not None)


def qwen_moe_layer(config, layer_idx: int) -> LlamaDecoderLayer:
    mlp = qwen_moe_block(config) if is_moe_layer(config, layer_idx) else LlamaMLP(config)
    return LlamaDecoderLayer(config, layer_idx, mlp=mlp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    make_layer = staticmethod(qwen_moe_layer)
    map_checkpoint_name = staticmethod(map_expert_checkpoint_name)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Same blocks; the config's ``shared_expert_intermediate_size`` and ``qkv_bias`` make the difference."""
