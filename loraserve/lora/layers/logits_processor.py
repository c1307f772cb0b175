"""lm_head LoRA on the logits: logits = h W^T + s * B(A h), A (r, H), B (V, r).

Wraps the LogitsProcessor (adapters call it ``lm_head``). The base logits are gathered across the
vocab-parallel ranks and cut to the vocabulary first (the sharded-to-full reindex), then the delta is
added with B whole, so the result is the same on every rank. With tied embeddings the lm_head weight
is the embedding's Parameter; this wrapper holds only the LoRA, so an adapter on ``embed_tokens``
and one on ``lm_head`` stay independent, as in PEFT. Extras (vocab_extras.py): a replacement lm_head
weight, trainable-token columns (tied embeddings), DoRA over the vocabulary rows.
"""

from __future__ import annotations

import torch

from loraserve.config import LoRAConfig
from loraserve.forward_context import current_lora_mapping
from loraserve.layers.vocab import LogitsProcessor, ParallelLMHead
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces
from loraserve.lora.layers.vocab_extras import VocabExtras


class LogitsProcessorWithLoRA(BaseLayerWithLoRA, VocabExtras):
    slot_has_extras = VocabExtras.slot_has_extras  # NOTE: BaseLayerWithLoRA's default comes first in the MRO

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
        self.init_extras(max_loras, self.vocab_size, dev)

    def reset_lora(self, index: int) -> None:
        self.lora_a_stacked[index].zero_()
        self.lora_b_stacked[index].zero_()
        self.slot_ranks[index] = 0
        self.clear_extras(index)

    def set_extras(
        self, index: int, lm_head_weight: torch.Tensor, weight=None, token_ids=None, token_rows=None, magnitude=None
    ) -> None:
        """After set_lora: a replacement weight (V, H), trainable tokens (ids, rows (n, H)), DoRA m (V,).

        ``lm_head_weight``: the full (V, H) base weight, for the DoRA norm."""
        dora = None
        if magnitude is not None:
            r = self.slot_ranks[index]
            a = self.lora_a_stacked[index, 0, :r].float()
            b = self.lora_b_stacked[index, 0, :, :r].float()
            w = (weight if weight is not None else lm_head_weight).float().to(a.device)
            dora = magnitude.to(a.device).float() / torch.linalg.norm(w + b @ a, dim=1)
        self.set_vocab_extras(index, weight, token_ids, token_rows, dora, self.vocab_size, lm_head_weight.dtype)

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
        slots = [s for s, _ in mapping.logit_segments]
        if self.has_extras(slots):
            return self._forward_with_extras(logits.float(), hidden, mapping).to(logits.dtype).float()
        if not self.adds_delta(mapping, slots):
            return logits.float()
        acc = logits.float()
        self.punica_wrapper.add_lora_logits(acc, hidden, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks)
        # NOTE: round to the model dtype once, as PEFT's lm_head Linear does, then hand fp32 to the sampler
        return acc.to(logits.dtype).float()

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is LogitsProcessor

    def _forward_with_extras(self, acc: torch.Tensor, hidden: torch.Tensor, mapping) -> torch.Tensor:
        for slot, idx in mapping.logit_segments:
            if slot in self.replacement:
                acc[idx] = torch.nn.functional.linear(hidden[idx], self.replacement[slot]).float()
            if slot in self.tokens:
                pos, rows = self.tokens[slot]
                ids = (pos >= 0).nonzero()[:, 0]
                cols = torch.nn.functional.linear(hidden[idx], rows[pos[ids]]).float()  # (n, len(ids))
                acc[idx[:, None], ids[None, :]] = cols
        delta = torch.zeros_like(acc)
        self.punica_wrapper.add_lora_logits(delta, hidden, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks)
        if self.dora_scale is not None:
            g = self.dora_scale[mapping.logit_slots]
            return g * acc + g * delta
        return acc + delta
