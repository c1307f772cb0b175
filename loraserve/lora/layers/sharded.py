"""Fully sharded LoRA (S-LoRA), chosen by ``LoRAConfig.fully_sharded_loras`` (``--fully-sharded-loras``).

The default wrappers keep A whole on column layers and B whole on row layers; these shard those too:

- Column family (Column / MergedColumn / QKV / MergedQKV): A is sliced by rank. An adapter of rank r
  gives each TP rank k the rows [k*c, (k+1)*c) of A, c = ceil(r / tp), so every rank does 1/tp of
  the shrink whatever r is. The shrink outputs (T, R/tp) are all-gathered into (T, R), with rank k's
  rows at columns [k*R/tp, k*R/tp + c) (R = max_lora_rank); B's columns are stored at the same places
  (zeros between), and B is still sliced by output as in the default mode.
- Row: A is sliced by input (as in the default mode), the shrink's partial sums are all-reduced
  (T, R), then B is sliced by output: each rank adds B_k(Ax) into its own output columns of the
  partial product, so the base all-reduce that follows also carries the LoRA delta.

At TP=1 the layout equals the default one and the default path runs. DoRA and row-parallel bias
extras are refused under TP > 1 when the adapter is packed (packing.py); column bias deltas work.
"""

from __future__ import annotations

import torch

from loraserve.config import ConfigError, LoRAConfig
from loraserve.distributed.comm import tp_all_gather, tp_all_reduce
from loraserve.distributed.parallel_state import divide
from loraserve.forward_context import current_lora_mapping
from loraserve.lora.errors import LoRAUnsupportedFeatureError
from loraserve.lora.layers.base import LoRAPieces
from loraserve.lora.layers.column_parallel_linear import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
)
from loraserve.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA


def _rank_chunk(r: int, tp_size: int) -> int:
    return -(-r // tp_size)  # ceil(r / tp)


class _ColumnShardedLoRA:
    """Mixin ahead of a column-parallel LoRA wrapper: A sliced by rank, the shrink output all-gathered."""

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        super().create_lora_weights(max_loras, lora_config, model_config)
        R = lora_config.max_lora_rank
        if R % self.tp_size:
            raise ConfigError(
                f"--fully-sharded-loras shards the LoRA rank: max_lora_rank ({R}) must be divisible by "
                f"tensor_parallel_size ({self.tp_size}); raise --max-lora-rank to a multiple of it"
            )
        self.rank_shard = R // self.tp_size
        a = self.lora_a_stacked[0]
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, 1, self.rank_shard, self.input_size, dtype=a.dtype, device=a.device)
            for _ in self.output_slices
        )  # per slice (max_loras, 1, R/tp, in)
        self.expand_ranks = [0] * max_loras  # columns of the gathered (T, R) buffer B reads, per slot

    def reset_lora(self, index: int) -> None:
        super().reset_lora(index)
        self.expand_ranks[index] = 0

    def slice_lora_a(self, lora_a: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        out = []
        for a in lora_a:
            if a is None:
                out.append(None)
                continue
            r = a.shape[0]
            c = _rank_chunk(r, self.tp_size)
            lo, hi = min(self.tp_rank * c, r), min((self.tp_rank + 1) * c, r)
            out.append(a[lo:hi])  # (<= c, in); the last ranks may get fewer (or no) rows
        return out

    def set_lora(self, index: int, lora_a: LoRAPieces, lora_b: LoRAPieces) -> None:
        self.reset_lora(index)
        full_a = self.as_slices(lora_a, self.n_slices)
        a_list = self.slice_lora_a(full_a)
        b_list = self.slice_lora_b(self.as_slices(lora_b, self.n_slices))
        rs, chunk = self.rank_shard, 0
        for i, (fa, a, b) in enumerate(zip(full_a, a_list, b_list)):
            if fa is None:
                continue
            r = fa.shape[0]
            c = _rank_chunk(r, self.tp_size)
            self.lora_a_stacked[i][index, 0, : a.shape[0]].copy_(a, non_blocking=True)
            for k in range(self.tp_size):  # rank k's A rows [k*c, (k+1)*c) land at gathered columns k*R/tp..
                lo, hi = min(k * c, r), min((k + 1) * c, r)
                if hi > lo:
                    self.lora_b_stacked[i][index, 0, :, k * rs : k * rs + hi - lo].copy_(
                        b[:, lo:hi], non_blocking=True
                    )
            chunk = max(chunk, c)
        self.slot_ranks[index] = chunk  # shrink rows on this rank (zero past its share)
        self.expand_ranks[index] = (self.tp_size - 1) * rs + chunk if chunk else 0

    def apply_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().apply_lora(out, x)
        mapping = current_lora_mapping()
        if mapping is None or not mapping.has_lora:
            return out
        active = mapping.active_slots
        if any(self.slot_has_dora[s] for s in active):
            raise LoRAUnsupportedFeatureError(
                "DoRA with --fully-sharded-loras under tensor parallelism is not supported"
            )
        acc = out.float()
        if any(self.slot_has_bias[s] for s in active):
            acc = acc + self.bias_delta[mapping.token_slots]  # -1 picks the zero row
        buf = torch.zeros(
            self.n_slices, x.shape[0], self.rank_shard, dtype=torch.float32, device=x.device
        )  # (S, T, R/tp)
        for i, a in enumerate(self.lora_a_stacked):
            self.punica_wrapper.add_shrink(buf[i], x, a, self.slot_ranks)
        full = tp_all_gather(buf, dim=-1)  # (S, T, R)
        offset = 0
        for i, (b, n) in enumerate(zip(self.lora_b_stacked, self.output_slices)):
            self.punica_wrapper.add_expand(acc, full[i], b, self.expand_ranks, offset, x.dtype)
            offset += n
        return acc.to(out.dtype)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return bool(lora_config.fully_sharded_loras) and super().can_replace_layer(
            source_layer, lora_config, packed_modules_list, model_config
        )


class ColumnParallelLinearWithShardedLoRA(_ColumnShardedLoRA, ColumnParallelLinearWithLoRA):
    pass


class MergedColumnParallelLinearWithShardedLoRA(_ColumnShardedLoRA, MergedColumnParallelLinearWithLoRA):
    pass


class QKVParallelLinearWithShardedLoRA(_ColumnShardedLoRA, QKVParallelLinearWithLoRA):
    pass


class MergedQKVParallelLinearWithShardedLoRA(_ColumnShardedLoRA, MergedQKVParallelLinearWithLoRA):
    pass


class RowParallelLinearWithShardedLoRA(RowParallelLinearWithLoRA):
    """A sliced by input, B by output; the LoRA delta rides in the base all-reduce."""

    def __init__(self, base_layer):
        super().__init__(base_layer)
        self.output_slices = (divide(base_layer.output_size, self.tp_size),)  # B's rows on this rank

    def slice_lora_b(self, lora_b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        n = self.output_slices[0]
        return [None if b is None else b.narrow(0, self.tp_rank * n, n) for b in lora_b]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.tp_size == 1:
            return super().forward(x)
        partial = base.forward_partial(x)  # (T, out): this rank's input columns
        mapping = current_lora_mapping()
        if mapping is None or not mapping.has_lora:
            return base.finish(partial)
        if any(self.slot_has_bias[s] or self.slot_has_dora[s] for s in mapping.active_slots):
            raise LoRAUnsupportedFeatureError(
                "DoRA and bias extras on row-parallel layers under tensor parallelism"
            )
        a = self.lora_a_stacked[0]
        buf = torch.zeros(x.shape[0], a.shape[2], dtype=torch.float32, device=x.device)  # (T, R)
        self.punica_wrapper.add_shrink(buf, x, a, self.slot_ranks)
        tp_all_reduce(buf)  # sum_k A_k x_k = Ax
        acc = partial.float()
        n = self.output_slices[0]
        self.punica_wrapper.add_expand(acc, buf, self.lora_b_stacked[0], self.slot_ranks, self.tp_rank * n, x.dtype)
        return base.finish(acc.to(partial.dtype))

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return bool(lora_config.fully_sharded_loras) and super().can_replace_layer(
            source_layer, lora_config, packed_modules_list, model_config
        )
