"""The batch's LoRA mapping and the wrapper that applies it (Punica / S-LoRA style).

``LoRAMapping`` is built once per forward by the LoRA manager and travels in the forward context:
per-token slot (-1 = base), tokens sorted by slot as segments, the same for the logits rows.
``PunicaWrapper`` is what layers call (``add_lora_linear`` / ``add_lora_embedding`` /
``add_lora_logits``); it reads the current mapping from the context and dispatches to the backend
ops, chosen once at construction (torch reference on CPU, Triton kernels on CUDA when available).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.forward_context import current_lora_mapping
from loraserve.lora.ops import torch_ops


def _segments(slots: torch.Tensor) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor, list[int], list[int]]:
    """slots (T,) -> (segments [(slot, indices)], order, starts, lens) over tokens sorted by slot (>= 0 only)."""
    order = torch.argsort(slots, stable=True)
    sorted_slots = slots[order]
    uniq, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
    segs, starts, lens = [], [], []
    pos = 0
    for s, c in zip(uniq.tolist(), counts.tolist()):
        if s >= 0:
            segs.append((s, order[pos : pos + c]))
            starts.append(pos)
            lens.append(c)
        pos += c
    return segs, order, starts, lens


@dataclass
class LoRAMapping:
    token_slots: torch.Tensor  # (T,) long, -1 = base model
    logit_slots: torch.Tensor  # (R,) long, for the rows whose logits are computed
    token_segments: list[tuple[int, torch.Tensor]]
    logit_segments: list[tuple[int, torch.Tensor]]
    token_order: torch.Tensor  # (T,) token indices sorted by slot
    seg_starts: list[int]
    seg_lens: list[int]

    @classmethod
    def build(cls, token_slots: list[int], logit_slots: list[int], device: torch.device) -> LoRAMapping:
        ts = torch.tensor(token_slots, dtype=torch.long, device=device)
        ls = torch.tensor(logit_slots, dtype=torch.long, device=device)
        tseg, order, starts, lens = _segments(ts)
        lseg, _, _, _ = _segments(ls)
        return cls(ts, ls, tseg, lseg, order, starts, lens)

    @property
    def has_lora(self) -> bool:
        return bool(self.token_segments)

    @property
    def has_logits_lora(self) -> bool:
        return bool(self.logit_segments)

    @property
    def active_slots(self) -> list[int]:
        return [s for s, _ in self.token_segments]


class PunicaWrapper:
    def __init__(self, max_loras: int, device: torch.device):
        self.max_loras = max_loras
        self.device = device
        self.ops = torch_ops  # NOTE: GPU kernels plug in here, chosen once by device type

    @staticmethod
    def mapping() -> LoRAMapping | None:
        return current_lora_mapping()

    def add_shrink(self, buf: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, ranks: list[int]) -> None:
        self.ops.lora_shrink(x, lora_a, self.mapping().token_segments, ranks, buf)

    def add_expand(self, y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, ranks: list[int], offset: int) -> None:
        self.ops.lora_expand(y, buf, lora_b, self.mapping().token_segments, ranks, offset)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        ranks: list[int],
        segments: list | None = None,
    ) -> None:
        """y (T, sum(output_slices)) fp32 += per-slice B_i(A_i x) for each token's slot."""
        segs = self.mapping().token_segments if segments is None else segments
        offset = 0
        for a, b, n in zip(lora_a_stacked, lora_b_stacked, output_slices):
            buf = torch.zeros(x.shape[0], a.shape[2], dtype=torch.float32, device=x.device)  # (T, R)
            self.ops.lora_shrink(x, a, segs, ranks, buf)
            self.ops.lora_expand(y, buf, b, segs, ranks, offset)
            offset += n

    def add_lora_embedding(
        self, y: torch.Tensor, ids: torch.Tensor, emb_a: torch.Tensor, lora_b: torch.Tensor, ranks: list[int]
    ) -> None:
        self.ops.lora_embedding(y, ids, emb_a, lora_b, self.mapping().token_segments, ranks)

    def add_lora_logits(
        self, y: torch.Tensor, h: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: list[int]
    ) -> None:
        """y (R, V) fp32 += B(A h) for each logits row's slot."""
        self.add_lora_linear(y, h, (lora_a,), (lora_b,), (lora_b.shape[2],), ranks, self.mapping().logit_segments)
