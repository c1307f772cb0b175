"""Per-slot vocabulary extras shared by the embedding and lm_head wrappers (PEFT features beyond A, B):

- a replacement weight (V, H): ``modules_to_save`` copies and saved embedding copies that differ
  from the base (served per request, not written into the base);
- trainable tokens: replacement rows for a few token ids (``W.index_copy(0, ids, delta)``);
- DoRA: g = m / n per output feature (H for embeddings, V for lm_head), computed once per slot.

Stored sparsely (dicts by slot): a replacement weight is as big as the embedding, so nothing is
preallocated; its memory is part of the adapter's size.
"""

from __future__ import annotations

import torch


class VocabExtras:
    def init_extras(self, max_loras: int, n_features: int, device: torch.device) -> None:
        self.max_loras = max_loras
        self.replacement: dict[int, torch.Tensor] = {}  # slot -> (V, H) in the model dtype
        self.tokens: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # slot -> (position of id or -1 (V,), rows)
        self.dora_scale: torch.Tensor | None = None  # (S + 1, n_features) fp32, last row = ones
        self.slot_has_dora = [False] * max_loras
        self._n_features, self._device = n_features, device

    def clear_extras(self, index: int) -> None:
        self.replacement.pop(index, None)
        self.tokens.pop(index, None)
        if self.slot_has_dora[index]:
            self.dora_scale[index].fill_(1.0)
            self.slot_has_dora[index] = False

    def set_vocab_extras(
        self,
        index: int,
        weight: torch.Tensor | None,
        token_ids: list[int] | None,
        token_rows: torch.Tensor | None,
        dora_scale: torch.Tensor | None,
        vocab_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.clear_extras(index)
        if weight is not None:
            self.replacement[index] = weight.to(device=self._device, dtype=dtype)
        if token_ids is not None:
            pos = torch.full((vocab_size,), -1, dtype=torch.long, device=self._device)
            pos[torch.tensor(token_ids, dtype=torch.long, device=self._device)] = torch.arange(
                len(token_ids), device=self._device
            )
            self.tokens[index] = (pos, token_rows.to(device=self._device, dtype=dtype))
        if dora_scale is not None:
            if self.dora_scale is None:
                self.dora_scale = torch.ones(self.max_loras + 1, self._n_features, device=self._device)
            self.dora_scale[index] = dora_scale.float()
            self.slot_has_dora[index] = True

    def slot_has_extras(self, index: int) -> bool:
        return self.has_extras([index])

    def adds_delta(self, mapping, slots: list[int]) -> bool:
        """Whether this step adds the layer's A/B delta: some slot of ``slots`` has a rank here (or the mapping's
        ``vocab_lora``, where a CUDA graph decided it). Where none has, the delta is exactly zero and the wrapper
        returns the base output, the same bits as adding it (x.float() plus zeros, rounded back, is x), without
        its launches: an lm_head's fp32 logits rounded and widened again, the shrink, the expand over the vocab."""
        if mapping.vocab_lora is not None:
            return mapping.vocab_lora
        return any(self.slot_ranks[s] for s in slots)

    def has_extras(self, slots: list[int]) -> bool:
        return any(s in self.replacement or s in self.tokens or self.slot_has_dora[s] for s in slots)
