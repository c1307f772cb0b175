"""Shared machinery of the linear LoRA wrappers: n output slices, each with its own A and B."""

from __future__ import annotations

import torch

from loraserve.config import LoRAConfig
from loraserve.forward_context import current_lora_mapping
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces


class BaseLinearLayerWithLoRA(BaseLayerWithLoRA):
    """Subclasses set: ``input_size`` (A's columns on this rank), ``output_slices`` (B's rows per slice on
    this rank) and ``full_shapes`` (per slice, the unsharded (in, out) an adapter must match)."""

    input_size: int
    output_slices: tuple[int, ...]
    full_shapes: list[tuple[int, int]]

    def __init__(self, base_layer):
        super().__init__()
        self.base_layer = base_layer
        self.tp_rank, self.tp_size = base_layer.tp_rank, base_layer.tp_size

    @property
    def n_slices(self) -> int:
        return len(self.output_slices)

    def expected_shapes(self) -> list[tuple[int, int]]:
        return self.full_shapes

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        rank, dtype = lora_config.max_lora_rank, lora_config.resolved_dtype()
        dev = self.base_layer.weight.device
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, 1, rank, self.input_size, dtype=dtype, device=dev) for _ in self.output_slices
        )  # per slice (max_loras, 1, R, in)
        self.lora_b_stacked = tuple(
            torch.zeros(max_loras, 1, n, rank, dtype=dtype, device=dev) for n in self.output_slices
        )  # per slice (max_loras, 1, out, R)
        self.slot_ranks = [0] * max_loras

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[index].zero_()
            b[index].zero_()
        self.slot_ranks[index] = 0

    def set_lora(self, index: int, lora_a: LoRAPieces, lora_b: LoRAPieces) -> None:
        self.reset_lora(index)
        a_list = self.slice_lora_a(self.as_slices(lora_a, self.n_slices))
        b_list = self.slice_lora_b(self.as_slices(lora_b, self.n_slices))
        rank = 0
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if a is None:
                continue
            r = a.shape[0]
            self.lora_a_stacked[i][index, 0, :r].copy_(a, non_blocking=True)
            self.lora_b_stacked[i][index, 0, :, :r].copy_(b, non_blocking=True)
            rank = max(rank, r)
        self.slot_ranks[index] = rank

    def apply_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + per-token LoRA delta, accumulated in fp32 and rounded once (PEFT's non-mixed path)."""
        mapping = current_lora_mapping()
        if mapping is None or not mapping.has_lora:
            return out
        acc = out.float()
        self.punica_wrapper.add_lora_linear(
            acc, x, self.lora_a_stacked, self.lora_b_stacked, self.output_slices, self.slot_ranks
        )
        return acc.to(out.dtype)
