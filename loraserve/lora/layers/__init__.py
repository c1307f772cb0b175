"""LoRA wrappers, one file per family. ``LORA_LAYER_CLASSES`` is the order the manager asks them in."""

from loraserve.lora.layers.base import BaseLayerWithLoRA
from loraserve.lora.layers.column_parallel_linear import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
)
from loraserve.lora.layers.fused_moe import FusedMoEWithLoRA
from loraserve.lora.layers.logits_processor import LogitsProcessorWithLoRA
from loraserve.lora.layers.replicated_linear import ReplicatedLinearWithLoRA
from loraserve.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA
from loraserve.lora.layers.sharded import (
    ColumnParallelLinearWithShardedLoRA,
    MergedColumnParallelLinearWithShardedLoRA,
    MergedQKVParallelLinearWithShardedLoRA,
    QKVParallelLinearWithShardedLoRA,
    RowParallelLinearWithShardedLoRA,
)
from loraserve.lora.layers.vocab_parallel_embedding import VocabParallelEmbeddingWithLoRA

LORA_LAYER_CLASSES: list[type[BaseLayerWithLoRA]] = [
    # fully_sharded_loras only (sharded.py); ahead of the plain classes they refine
    ColumnParallelLinearWithShardedLoRA,
    MergedColumnParallelLinearWithShardedLoRA,
    QKVParallelLinearWithShardedLoRA,
    MergedQKVParallelLinearWithShardedLoRA,
    RowParallelLinearWithShardedLoRA,
    ReplicatedLinearWithLoRA,
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearVariableSliceWithLoRA,
    QKVParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    VocabParallelEmbeddingWithLoRA,
    LogitsProcessorWithLoRA,
    FusedMoEWithLoRA,
]

__all__ = [c.__name__ for c in LORA_LAYER_CLASSES] + ["BaseLayerWithLoRA", "LORA_LAYER_CLASSES"]
