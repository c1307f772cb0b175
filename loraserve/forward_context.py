"""One scoped context per forward pass: attention metadata and the LoRA mapping.

Model forwards stay ``(input_ids, positions)``; only attention and LoRA layers read this.
Nesting is refused, and the context is always cleared on exit.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loraserve.lora.punica import LoRAMapping


@dataclass
class AttentionMetadata:
    """Varlen batch: sequence i owns query rows [query_starts[i], query_starts[i] + query_lens[i])."""

    slot_mapping: torch.Tensor  # (T,) cache slot of each new token
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache after this step, per sequence
    kv_slots: list[torch.Tensor]  # cache slots of positions [0, context_len), per sequence (CPU path)
    block_tables: torch.Tensor | None = None  # (B, max_blocks) int32, for GPU kernels
    seq_info: torch.Tensor | None = None  # (B, 3) int32 [query_start, query_len, context_len], GPU kernels
    block_size: int = 16  # KV cache block size: slot = block * block_size + offset
    gpu_cache: dict = field(default_factory=dict)  # per-forward derived tensors (GPU work lists, rope cos/sin)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None = None
    lora: LoRAMapping | None = None
    extra: dict[str, Any] | None = None
    cuda_graph: bool = False  # a decode graph's forward (its warm-up run and its capture alike)
    # (an output, the LoRA delta its projection left to that output's reader): defer_delta / take_deferred_delta
    deferred_delta: tuple[torch.Tensor, Any] | None = None


_CURRENT: ForwardContext | None = None


@contextmanager
def forward_context(attn: AttentionMetadata | None = None, lora: LoRAMapping | None = None, cuda_graph: bool = False):
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("forward_context is already active; nested forwards are not supported")
    _CURRENT = ForwardContext(attn=attn, lora=lora, cuda_graph=cuda_graph)
    try:
        yield _CURRENT
        check_no_deferred_delta()
    finally:
        _CURRENT = None


def get_forward_context() -> ForwardContext:
    if _CURRENT is None:
        raise RuntimeError("no forward_context: run the model inside `with forward_context(...)`")
    return _CURRENT


def get_forward_context_or_none() -> ForwardContext | None:
    return _CURRENT


def current_lora_mapping() -> LoRAMapping | None:
    return None if _CURRENT is None else _CURRENT.lora


def defer_delta(y: torch.Tensor, delta: Any) -> None:
    """Leave ``delta`` (``punica.PendingDelta`` or ``PendingQKVDelta``) to the next reader of y, which must
    ``take_deferred_delta(y)`` before anything else defers: a projection does this only where its model says what
    reads its output (``output_feeds_norm``: the RMSNorm after it; ``output_feeds_rotary``: the attention)."""
    ctx = get_forward_context()
    check_no_deferred_delta()
    ctx.deferred_delta = (y, delta)


def take_deferred_delta(x: torch.Tensor) -> Any:
    """The delta deferred to x's reader (``defer_delta``), if x is that very output (once); else None."""
    ctx = _CURRENT
    if ctx is None or ctx.deferred_delta is None or ctx.deferred_delta[0] is not x:
        return None
    delta, ctx.deferred_delta = ctx.deferred_delta[1], None
    return delta


def check_no_deferred_delta() -> None:
    """Raise if a deferred LoRA delta was never taken: an output read by something other than the reader
    its projection was told of would miss its delta (a wrong model wiring, never silently)."""
    if _CURRENT is not None and _CURRENT.deferred_delta is not None:
        y = _CURRENT.deferred_delta[0]
        _CURRENT.deferred_delta = None
        raise RuntimeError(
            f"a LoRA delta deferred to the reader of an output {tuple(y.shape)} was never taken: the module marked "
            "output_feeds_norm (output_feeds_rotary) does not feed an RMSNorm (the attention's rotary launch) here; "
            "unmark it in the model file"
        )
