"""Mixtral and OLMoE: Llama-family decoders with sparse MoE MLPs from layers/moe.py.

- Mixtral: Mistral attention (sliding window from the config); the router always renormalizes the
  top-k softmax weights and keeps them in fp32 (HF's ``MixtralTopKRouter``).
- OLMoE: q/k RMSNorms over the whole q and k projections (not per head), optional ``clip_qkv``;
  renormalization per ``norm_topk_prob``, weights cast to the logits dtype.

Checkpoints: transformers 5 keeps Mixtral's v4 keys on save (``block_sparse_moe.experts.N.w1``);
``map_expert_checkpoint_name`` maps those and the fused ``mlp.experts.gate_up_proj`` layout alike.
"""

from __future__ import annotations

import torch

from loraserve.layers.moe import FusedMoE, RoutingConfig, SparseMoeBlock, map_expert_checkpoint_name
from loraserve.layers.norm import RMSNorm
from loraserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def mixtral_block(config) -> SparseMoeBlock:
    routing = RoutingConfig(config.num_experts_per_tok, renormalize=True, weights_fp32=True)
    experts = FusedMoE(
        config.num_local_experts,
        config.hidden_size,
        config.intermediate_size,
        routing,
        activation=config.hidden_act,
    )
    return SparseMoeBlock(experts)


def mixtral_layer(config, layer_idx: int) -> LlamaDecoderLayer:
    return LlamaDecoderLayer(config, layer_idx, mlp=mixtral_block(config))


class MixtralForCausalLM(LlamaForCausalLM):
    make_layer = staticmethod(mixtral_layer)
    map_checkpoint_name = staticmethod(map_expert_checkpoint_name)


class OlmoeAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        if self.qkv_proj.tp_size > 1:
            # NOTE: the norms span every head, i.e. every rank's shard; that needs a cross-rank reduction
            raise ValueError(
                "OLMoE with tensor parallelism is not supported yet; serve it with --tensor-parallel-size 1"
            )
        kv_heads = config.num_key_value_heads
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(
            (config.hidden_size // config.num_attention_heads) * kv_heads, config.rms_norm_eps
        )
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


def olmoe_block(config) -> SparseMoeBlock:
    routing = RoutingConfig(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
    experts = FusedMoE(
        config.num_experts,
        config.hidden_size,
        config.intermediate_size,
        routing,
        activation=config.hidden_act,
    )
    return SparseMoeBlock(experts)


def olmoe_layer(config, layer_idx: int) -> LlamaDecoderLayer:
    return LlamaDecoderLayer(
        config, layer_idx, mlp=olmoe_block(config), attn=OlmoeAttention(config, layer_idx)
    )


class OlmoeForCausalLM(LlamaForCausalLM):
    make_layer = staticmethod(olmoe_layer)
    map_checkpoint_name = staticmethod(map_expert_checkpoint_name)
