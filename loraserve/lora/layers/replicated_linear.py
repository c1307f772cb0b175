"""LoRA on a replicated linear (every rank holds the whole weight and the whole adapter)."""

from __future__ import annotations

import torch

from loraserve.layers.linear import ReplicatedLinear
from loraserve.lora.layers.base_linear import BaseLinearLayerWithLoRA


class ReplicatedLinearWithLoRA(BaseLinearLayerWithLoRA):
    def __init__(self, base_layer: ReplicatedLinear):
        super().__init__(base_layer)
        self.input_size = base_layer.input_size
        self.output_slices = (base_layer.output_size,)
        self.full_shapes = [(base_layer.input_size, base_layer.output_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.base_layer.weight, self.base_layer.bias)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is ReplicatedLinear
