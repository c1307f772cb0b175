"""Embedding LoRA: y = E[ids] + s * (A^T[ids] @ B^T), A (r, V), B (H, r), as PEFT's Embedding layer.

A^T is kept whole (all V rows) on every rank and the delta is added after the base embedding's
all-reduce, so it needs no vocab sharding of its own.
"""

from __future__ import annotations

import torch

from loraserve.config import LoRAConfig
from loraserve.forward_context import current_lora_mapping
from loraserve.layers.vocab import VocabParallelEmbedding
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces


class VocabParallelEmbeddingWithLoRA(BaseLayerWithLoRA):
    is_embedding = True

    def __init__(self, base_layer: VocabParallelEmbedding):
        super().__init__()
        self.base_layer = base_layer

    def expected_shapes(self) -> list[tuple[int, int]]:
        return [(self.base_layer.num_embeddings, self.base_layer.embedding_dim)]

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        rank, dtype = lora_config.max_lora_rank, lora_config.resolved_dtype()
        dev = self.base_layer.weight.device
        V, H = self.base_layer.num_embeddings, self.base_layer.embedding_dim
        self.lora_a_stacked = torch.zeros(max_loras, V, rank, dtype=dtype, device=dev)  # (S, V, R): A^T
        self.lora_b_stacked = torch.zeros(max_loras, 1, H, rank, dtype=dtype, device=dev)  # (S, 1, H, R)
        self.slot_ranks = [0] * max_loras

    def reset_lora(self, index: int) -> None:
        self.lora_a_stacked[index].zero_()
        self.lora_b_stacked[index].zero_()
        self.slot_ranks[index] = 0

    def set_lora(self, index: int, lora_a: LoRAPieces, lora_b: LoRAPieces) -> None:
        self.reset_lora(index)
        (a,), (b,) = self.as_slices(lora_a, 1), self.as_slices(lora_b, 1)
        if a is None:
            return
        r = a.shape[0]
        self.lora_a_stacked[index, :, :r].copy_(a.t(), non_blocking=True)
        self.lora_b_stacked[index, 0, :, :r].copy_(b, non_blocking=True)
        self.slot_ranks[index] = r

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(input_ids)
        mapping = current_lora_mapping()
        if mapping is None or not mapping.has_lora:
            return out
        acc = out.float()
        self.punica_wrapper.add_lora_embedding(acc, input_ids, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks)
        return acc.to(out.dtype)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is VocabParallelEmbedding
