"""Row-parallel LoRA: A sliced by input, B whole; the delta joins the partial sum before the all-reduce."""

from __future__ import annotations

import torch

from loraserve.layers.linear import RowParallelLinear
from loraserve.lora.layers.base_linear import BaseLinearLayerWithLoRA


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    def __init__(self, base_layer: RowParallelLinear):
        super().__init__(base_layer)
        self.input_size = base_layer.input_size_per_partition
        self.output_slices = (base_layer.output_size,)
        self.full_shapes = [(base_layer.input_size, base_layer.output_size)]

    def slice_lora_a(self, lora_a):
        n = self.input_size
        return [None if a is None else a.narrow(1, self.tp_rank * n, n) for a in lora_a]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.tp_size == 1:
            pw = self.punica_wrapper
            if base.output_feeds_norm and pw is not None and self._fusable():
                # the base product; the norm reading it adds the delta (row_delta)
                y = self.defer_to_reader(x, lambda shrunk: pw.linear_deferring_delta(
                    x, base.weight, base.bias, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks, shrunk=shrunk,
                    gemm_shrink_rows=self.gemm_shrink_rows,
                ))  # fmt: skip
                if y is not None:
                    return y
            # NOTE: PEFT's order, y = (Wx + b) + s*B(Ax), for bit-equal bf16 results at TP=1
            return self.linear(x, base.weight, base.bias)
        # B(A_i x_i) summed over ranks by the all-reduce = B(Ax)
        return base.finish(self.apply_lora(base.forward_partial(x), x))

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is RowParallelLinear
