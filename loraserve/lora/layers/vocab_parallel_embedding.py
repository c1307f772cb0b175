"""Embedding LoRA: y = E[ids] + s * (A^T[ids] @ B^T), A (r, V), B (H, r), as PEFT's Embedding layer.

A^T is kept whole (all V rows) on every rank and the delta is added after the base embedding's
all-reduce, so it needs no vocab sharding of its own. Extras (vocab_extras.py): a replacement
embedding, trainable-token rows, DoRA: y = g * E'[ids] + g * s * A^T[ids] B^T.
"""

from __future__ import annotations

import torch

from loraserve.config import LoRAConfig
from loraserve.distributed.comm import tp_all_reduce
from loraserve.forward_context import current_lora_mapping
from loraserve.layers.vocab import VocabParallelEmbedding
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces
from loraserve.lora.layers.vocab_extras import VocabExtras


class VocabParallelEmbeddingWithLoRA(BaseLayerWithLoRA, VocabExtras):
    slot_has_extras = VocabExtras.slot_has_extras  # NOTE: BaseLayerWithLoRA's default comes first in the MRO

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
        self.init_extras(max_loras, H, dev)

    def reset_lora(self, index: int) -> None:
        self.lora_a_stacked[index].zero_()
        self.lora_b_stacked[index].zero_()
        self.slot_ranks[index] = 0
        self.clear_extras(index)

    def set_extras(self, index: int, weight=None, token_ids=None, token_rows=None, magnitude=None) -> None:
        """After set_lora: a replacement weight (V, H), trainable tokens (ids, rows (n, H)), DoRA m (H,)."""
        dora = None
        if magnitude is not None:
            norm = self._dora_norm(index, weight)
            dora = magnitude.to(norm.device).float() / norm
        base = self.base_layer
        self.set_vocab_extras(index, weight, token_ids, token_rows, dora, base.num_embeddings, base.weight.dtype)

    def _dora_norm(self, index: int, weight: torch.Tensor | None) -> torch.Tensor:
        """n_h = ||(E^T + s*B*A)_h||_2 over the whole vocabulary (summed across vocab shards)."""
        base = self.base_layer
        r = self.slot_ranks[index]
        a_t = self.lora_a_stacked[index, :, :r].float()  # (V, r)
        b = self.lora_b_stacked[index, 0, :, :r].float()  # (H, r)
        if weight is not None:  # a full replacement: no sharding
            return torch.linalg.norm(weight.float().to(a_t.device) + a_t @ b.t(), dim=0)
        lo, hi = base.vocab_start, base.vocab_end
        local = base.weight[: hi - lo].float() + a_t[lo:hi] @ b.t()  # (V_local, H)
        return tp_all_reduce(local.pow(2).sum(dim=0)).sqrt()

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
        if not self.has_extras(mapping.active_slots):
            if not self.adds_delta(mapping, mapping.active_slots):
                return out
            acc = out.float()
            self.punica_wrapper.add_lora_embedding(acc, input_ids, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks)
            return acc.to(out.dtype)
        acc = out.float()
        for slot, idx in mapping.token_segments:
            if slot in self.replacement:
                acc[idx] = torch.nn.functional.embedding(input_ids[idx], self.replacement[slot]).float()
            if slot in self.tokens:
                pos, rows = self.tokens[slot]
                p = pos[input_ids[idx]]
                hit = p >= 0
                acc[idx[hit]] = rows[p[hit]].float()
        delta = torch.zeros_like(acc)
        self.punica_wrapper.add_lora_embedding(delta, input_ids, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks)
        if self.dora_scale is not None:
            g = self.dora_scale[mapping.token_slots]  # -1 picks the ones row
            return (g * acc + g * delta).to(out.dtype)
        return (acc + delta).to(out.dtype)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is VocabParallelEmbedding
