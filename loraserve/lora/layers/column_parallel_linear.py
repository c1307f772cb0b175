"""Column-parallel LoRA wrappers: A whole, B sliced by output (each slice on its own for packed layers).

- ColumnParallelLinearWithLoRA: one output.
- MergedColumnParallelLinearWithLoRA: gate_up_proj (2 slices: gate, up).
- MergedColumnParallelLinearVariableSliceWithLoRA: 3 or more packed outputs.
- QKVParallelLinearWithLoRA: one packed LoRA on a fused qkv (Phi-3 checkpoints); B is split into its
  q/k/v rows to shard by heads.
- MergedQKVParallelLinearWithLoRA: separate q/k/v LoRAs (3 slices, GQA sizes, replicated kv heads).
"""

from __future__ import annotations

import torch

from loraserve.distributed.comm import tp_all_gather
from loraserve.layers.activation import SiluAndMul
from loraserve.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear
from loraserve.lora.layers.base_linear import BaseLinearLayerWithLoRA
from loraserve.lora.ops import delta_in_k


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    def __init__(self, base_layer: ColumnParallelLinear):
        super().__init__(base_layer)
        self.input_size = base_layer.input_size
        self.output_slices = (base_layer.output_size_per_partition,)
        self.full_shapes = [(base_layer.input_size, base_layer.output_size)]

    def slice_lora_b(self, lora_b):
        base = self.base_layer
        if isinstance(base, MergedColumnParallelLinear) and len(lora_b) == 1 and lora_b[0] is not None:
            # one LoRA on a packed layer (a fused gate_up checkpoint): rank i holds [gate_i; up_i]
            parts, offset = [], 0
            for full, local in zip(base.output_sizes, base.output_partition_sizes):
                parts.append(lora_b[0].narrow(0, offset + self.tp_rank * local, local))
                offset += full
            return [torch.cat(parts, dim=0)]
        out = []
        for b, n in zip(lora_b, self.output_slices):
            out.append(None if b is None else b.narrow(0, self.tp_rank * n, n))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if getattr(base, "output_feeds_rotary", False) and not base.gather_output and self._fusable():
            pw = self.punica_wrapper
            # the base product; the attention's rotary launch adds the delta
            y = self.defer_to_reader(x, lambda shrunk: pw.qkv_deferring_delta(
                x, base.weight, base.bias, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks, shrunk))
            if y is not None:
                return y
        y = self.linear(x, base.weight, base.bias)
        return tp_all_gather(y) if base.gather_output else y

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is ColumnParallelLinear or (
            type(source_layer) is MergedColumnParallelLinear and len(packed_modules_list) == 1
        )


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    n_packed = 2
    # (delta_in_k) the widened W, where this layer takes its delta as more K; the norm's wider output for the next call
    w_in_k: torch.Tensor | None = None
    _in_k_input: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, base_layer: MergedColumnParallelLinear):
        BaseLinearLayerWithLoRA.__init__(self, base_layer)
        self.input_size = base_layer.input_size
        self.output_slices = tuple(base_layer.output_partition_sizes)
        self.full_shapes = [(base_layer.input_size, s) for s in base_layer.output_sizes]

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return (
            type(source_layer) is MergedColumnParallelLinear
            and len(packed_modules_list) == cls.n_packed
            and len(source_layer.output_sizes) == cls.n_packed
        )

    def create_lora_weights(self, max_loras: int, lora_config, model_config=None) -> None:
        super().create_lora_weights(max_loras, lora_config, model_config)
        # the delta as more K of the GEMM (delta_in_k, where it fits): W widened now, before any graph reads it
        sharded = bool(getattr(lora_config, "fully_sharded_loras", False))
        if self.n_slices == 2 and delta_in_k.applies(self.base_layer.weight, self.lora_b_stacked, self.tp_size, sharded):
            self.w_in_k = delta_in_k.widen(self.base_layer, self.lora_b_stacked)

    def reset_lora(self, index: int) -> None:
        super().reset_lora(index)
        self._write_in_k(index)

    def set_lora(self, index: int, lora_a, lora_b) -> None:
        if self.w_in_k is not None:  # before anything is written
            pieces = self.slice_lora_b(self.as_slices(lora_b, self.n_slices))
            delta_in_k.refuse_past_range(pieces, self.lora_b_stacked[0].dtype, self.w_in_k.dtype, index)
        super().set_lora(index, lora_a, lora_b)
        self._write_in_k(index)

    def _write_in_k(self, index: int) -> None:
        if self.w_in_k is not None:
            delta_in_k.write_slot(self.w_in_k, self.input_size, self.lora_b_stacked, index)

    def fuse_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, delta=None):
        """``BaseLinearLayerWithLoRA.fuse_norm``; where this layer takes its delta as more K (``w_in_k``), the norm
        writes the shrink as more columns of its output instead, kept for ``forward_activated``."""
        self._in_k_input = None
        pw = self.punica_wrapper
        if self.w_in_k is not None and pw is not None and self._fusable():
            fused = pw.norm_shrink(
                x, residual, weight, eps, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks,
                self.base_layer.weight, delta=delta, in_k=True,
            )  # fmt: skip
            if fused is not None:
                out, new_residual, x_wide = fused
                self._shrunk_input = None
                self._in_k_input = (out, x_wide)
                return out if residual is None else (out, new_residual)
        return super().fuse_norm(x, residual, weight, eps, delta)

    def forward_activated(self, x: torch.Tensor, act) -> torch.Tensor:
        """act(self(x)); for SiLU-and-mul on gate/up at decode sizes on the GPU, the delta is added in the
        activation's launch instead of the GEMM's epilogue where that is faster (``gated_lora``). Where the norm wrote x with its shrink as more columns (``fuse_norm``, ``delta_in_k``): one plain GEMM
        of that wider x and the wider W, then act."""
        base = self.base_layer
        in_k, self._in_k_input = self._in_k_input, None
        if in_k is not None and in_k[0] is x:
            # the norm took the fused path: on the GPU, so triton is importable
            from loraserve.layers import triton_decode_linear

            k_args = delta_in_k.gemm_args(self.input_size, self.lora_b_stacked)
            tiles = triton_decode_linear.default_tiles(x.shape[0], *self.w_in_k.shape, x.dtype, self.output_slices)
            return act(triton_decode_linear.decode_linear(in_k[1], self.w_in_k, base.bias, tiles=tiles, in_k=k_args))
        if isinstance(act, SiluAndMul) and not base.gather_output and self.n_slices == 2 and self._fusable():
            pending = self._shrunk_input
            out = self.punica_wrapper.linear_with_lora(
                x, base.weight, base.bias, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks,
                then_silu_and_mul=True, shrunk=self.take_shrunk(x),
            )
            if out is not None:
                return out
            self._shrunk_input = pending  # not taken: the epilogue path below uses it
        return act(self(x))


class MergedColumnParallelLinearVariableSliceWithLoRA(MergedColumnParallelLinearWithLoRA):
    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return (
            type(source_layer) is MergedColumnParallelLinear
            and len(packed_modules_list) >= 3
            and len(packed_modules_list) == len(source_layer.output_sizes)
        )


class MergedQKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    def __init__(self, base_layer: QKVParallelLinear):
        BaseLinearLayerWithLoRA.__init__(self, base_layer)
        self.input_size = base_layer.input_size
        self.output_slices = tuple(base_layer.output_partition_sizes)  # (q, k, v) on this rank
        self.full_shapes = [(base_layer.input_size, s) for s in base_layer.output_sizes]

    def slice_lora_b(self, lora_b):
        out = []
        for b, sid in zip(lora_b, ("q", "k", "v")):
            if b is None:
                out.append(None)
                continue
            _, size, start = self.base_layer.shard_offset(sid)
            out.append(b.narrow(0, start, size))
        return out

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is QKVParallelLinear and len(packed_modules_list) == 3


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    def __init__(self, base_layer: QKVParallelLinear):
        BaseLinearLayerWithLoRA.__init__(self, base_layer)
        self.input_size = base_layer.input_size
        self.output_slices = (sum(base_layer.output_partition_sizes),)
        self.full_shapes = [(base_layer.input_size, sum(base_layer.output_sizes))]

    def slice_lora_b(self, lora_b):
        (b,) = lora_b
        if b is None:
            return [None]
        q, k, _ = self.base_layer.output_sizes
        parts = []
        for sid, full in (("q", b[:q]), ("k", b[q : q + k]), ("v", b[q + k :])):
            _, size, start = self.base_layer.shard_offset(sid)
            parts.append(full.narrow(0, start, size))
        return [torch.cat(parts, dim=0)]

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return type(source_layer) is QKVParallelLinear and len(packed_modules_list) == 1
