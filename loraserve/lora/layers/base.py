"""BaseLayerWithLoRA: the contract every LoRA wrapper keeps (see ../shared/DESIGN.md).

A wrapper holds ``max_loras`` stacked slots of LoRA weights beside its ``base_layer`` and adds, for
each token, the delta of the adapter in that token's slot. Which slot each token uses arrives
through the punica wrapper (``set_mapping``), which reads the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.lora.punica import PunicaWrapper

LoRAPieces = torch.Tensor | list[torch.Tensor | None] | None


class BaseLayerWithLoRA(nn.Module):
    base_layer: nn.Module
    punica_wrapper: PunicaWrapper | None = None

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        """Allocate the stacked slots (zeros)."""
        raise NotImplementedError

    def reset_lora(self, index: int) -> None:
        """Zero slot ``index``: tokens mapped to it get the base output back."""
        raise NotImplementedError

    def set_lora(self, index: int, lora_a: LoRAPieces, lora_b: LoRAPieces) -> None:
        """Write one adapter (full, unsharded tensors; one per slice, None = no LoRA there) into slot ``index``."""
        raise NotImplementedError

    def slice_lora_a(self, lora_a: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """This TP rank's shard of A, per slice."""
        return lora_a

    def slice_lora_b(self, lora_b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """This TP rank's shard of B, per slice."""
        return lora_b

    def slot_has_extras(self, index: int) -> bool:
        """Whether slot ``index`` holds PEFT extras beyond A and B (DoRA, biases, replacement weights,
        trainable tokens). NOTE: a layer picks its extras path on the host per forward, so a CUDA graph
        bakes in what it saw at capture: steps that use such a slot must run eagerly."""
        return False

    def set_mapping(self, punica_wrapper: PunicaWrapper) -> None:
        self.punica_wrapper = punica_wrapper

    def expected_shapes(self) -> list[tuple[int, int]]:
        """Per slice, the full (unsharded) (A columns, B rows) an adapter must have."""
        raise NotImplementedError

    @classmethod
    def can_replace_layer(
        cls, source_layer: nn.Module, lora_config: LoRAConfig, packed_modules_list: list[str], model_config=None
    ) -> bool:
        raise NotImplementedError

    @staticmethod
    def as_slices(x: LoRAPieces, n: int) -> list[torch.Tensor | None]:
        if x is None:
            return [None] * n
        if isinstance(x, torch.Tensor):
            return [x]
        assert len(x) == n, f"expected {n} slices, got {len(x)}"
        return list(x)
