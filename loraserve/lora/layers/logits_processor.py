"""lm_head LoRA on the logits: logits = h W^T + s * B(A h), A (r, H), B (V, r).

Wraps the LogitsProcessor (adapters call it ``lm_head``). The base logits are gathered across the
vocab-parallel ranks and cut to the vocabulary first (the sharded-to-full reindex), then the delta is
added with B whole, so the result is the same on every rank. With tied embeddings the lm_head weight
is the embedding's Parameter; this wrapper holds only the LoRA, so an adapter on ``embed_tokens``
and one on ``lm_head`` stay independent, as in PEFT.
"""

from __future__ import annotations

import torch

from loraserve.config import LoRAConfig
from loraserve.forward_context import current_lora_mapping
from loraserve.layers.vocab import LogitsProcessor, ParallelLMHead
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces


class LogitsProcessorWithLoRA(BaseLayerWithLoRA):
    def __init__(self, base_layer: LogitsProcessor, hidden_size: int, device: torch.device | None = None):
        super().__init__()
        self.base_layer = base_layer
        self._device = device or torch.device("cpu")
        self.hidden_size = hidden_size
        self.vocab_size = base_layer.vocab_size

    def expected_shapes(self) -> list[tuple[int, int]]:
        return [(self.hidden_size, self.vocab_size)]

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        rank, dtype = lora_config.max_lora_rank, lora_config.resolved_dtype()
        dev = self._device
        self.lora_a_stacked = torch.zeros(max_loras, 1, rank, self.hidden_size, dtype=dtype, device=dev)
        self.lora_b_stacked = torch.zeros(max_loras, 1, self.vocab_size, rank, dtype=dtype, device=dev)
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
        self.lora_a_stacked[index, 0, :r].copy_(a, non_blocking=True)
        self.lora_b_stacked[index, 0, :, :r].copy_(b, non_blocking=True)
        self.slot_ranks[index] = r

    def forward(self, lm_head: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base_layer.gather(self.base_layer.get_logits_shard(lm_head, hidden))  # (R, V)
        mapping = current_lora_mapping()
        if mapping is None or not mapping.has_logits_lora:
            return logits.float()
        acc = logits.float()
        self.punica_wrapper.add_lora_logits(acc, hidden, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks)
        # NOTE: round to the model dtype once, as PEFT's lm_head Linear does, then hand fp32 to the sampler
        return acc.to(logits.dtype).float()

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is LogitsProcessor
