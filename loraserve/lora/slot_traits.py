"""What a device slot's adapter asks of a step's path (``SlotTraits``), kept per slot by the LoRA manager."""

from __future__ import annotations

import dataclasses

from loraserve.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA
from loraserve.lora.layers.vocab_extras import VocabExtras


@dataclasses.dataclass(frozen=True)
class SlotTraits:
    """What a slot's adapter asks of a step's path, read from the modules once it is written (an empty slot's
    are the defaults): PEFT extras (DoRA, biases, ...: the step runs eagerly), an embedding or lm_head A/B (the
    vocab deltas run), every row-parallel layer's A exactly in its weight's dtype (their GEMMs' shrink reads one
    piece of A). The last two are CUDA graphs' keys."""

    extras: bool = False
    vocab_lora: bool = False
    a_exact_in_w: bool = True

    @classmethod
    def of(cls, slot: int, modules) -> SlotTraits:
        modules = list(modules)
        return cls(
            extras=any(m.slot_has_extras(slot) for m in modules),
            vocab_lora=any(m.slot_ranks[slot] for m in modules if isinstance(m, VocabExtras)),
            # (only the row-parallel layers' GEMM computes a shrink from A's pieces: gemm_shrink_rows)
            a_exact_in_w=all(
                m.slot_a_exact_in_w[slot] for m in modules if isinstance(m, RowParallelLinearWithLoRA)
            ),
        )
