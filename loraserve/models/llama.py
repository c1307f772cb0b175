"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM2.

Module paths mirror HF's (``model.layers.N.self_attn.qkv_proj`` packs q/k/v_proj), so checkpoint
and adapter keys map by name.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.forward_context import take_deferred_delta
from loraserve.layers.activation import SiluAndMul
from loraserve.layers.attention import Attention
from loraserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loraserve.layers.norm import RMSNorm
from loraserve.layers.rotary import RotaryEmbedding
from loraserve.layers.vocab import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from loraserve.models.interfaces import SupportsLoRA


def _sliding_window(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        model_type = config.model_type
        attn_bias = getattr(config, "attention_bias", False)
        qkv_bias = True if model_type == "qwen2" else getattr(config, "qkv_bias", attn_bias)  # qwen2_moe: qkv_bias
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=attn_bias and model_type != "qwen2")
        self.qk_norm = model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=_sliding_window(config, layer_idx),
        )

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        T = h.shape[0]
        qkv = self.qkv_proj(h)
        # a LoRA'd qkv_proj marked output_feeds_rotary may leave its delta to the attention's rotary launch
        delta = take_deferred_delta(qkv)
        if delta is not None and (self.qk_norm or not self.attn.takes_qkv_delta(self.rotary_emb)):
            qkv, delta = delta.add_to(qkv), None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(T, -1, self.head_dim))  # (T, Hq, D)
            k = self.k_norm(k.reshape(T, -1, self.head_dim))  # (T, Hk, D)
        o = self.attn(q, k, v, positions, self.rotary_emb, qkv_delta=delta)  # rotary + cache write fused on the GPU
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_activated(h, self.act_fn))


class LlamaDecoderLayer(nn.Module):
    """``mlp`` / ``attn``: the block's own modules (MoE families pass theirs); default Llama's.

    Runs on a residual stream (vLLM's layout): ``forward(positions, h, residual) -> (h, residual)``
    where the hidden state is ``h + residual``, the adds done by the norms (one launch each on the
    GPU: ``RMSNorm(x, residual)``). The first layer gets the embeddings and ``residual=None``; the
    model's final norm adds the last layer's pair. The sums are the ones ``h = h + attn(norm(h))``
    makes, in the same order of rounding, so the result is bit-identical to that formulation.
    """

    def __init__(self, config, layer_idx: int, mlp: nn.Module | None = None, attn: nn.Module | None = None):
        super().__init__()
        self.self_attn = attn if attn is not None else LlamaAttention(config, layer_idx)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Llama's o_proj and down return their output as is, and it goes straight into the next norm (the
        # post-attention one; the next layer's input norm, or the model's final one): a LoRA'd one may leave
        # its delta to that norm (row_delta); qkv_proj's may go to the attention's rotary launch, which
        # LlamaAttention hands it (not with q/k norms in between). Other modules' (MoE blocks, Olmoe's attention)
        # are not marked.
        if type(self.self_attn) is LlamaAttention:
            self.self_attn.o_proj.output_feeds_norm = True
            self.self_attn.qkv_proj.output_feeds_rotary = not self.self_attn.qk_norm
        if type(self.mlp) is LlamaMLP:
            self.mlp.down_proj.output_feeds_norm = True

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # feeds: the projection each norm's output goes to (a LoRA'd one may fuse its shrink into the norm)
        qkv, gate_up = getattr(self.self_attn, "qkv_proj", None), getattr(self.mlp, "gate_up_proj", None)
        if residual is None:
            residual, h = h, self.input_layernorm(h, feeds=qkv)
        else:
            h, residual = self.input_layernorm(h, residual, feeds=qkv)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual, feeds=gate_up)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, make_layer=LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module, SupportsLoRA):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    # (our param, checkpoint name, shard id) for checkpoints that store the pieces separately
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    make_layer = LlamaDecoderLayer  # (config, layer_idx) -> decoder layer; the MoE families pass their own

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self).make_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden)
