"""A packed projection's LoRA delta as more K of its base GEMM (opt-in, ``LORASERVE_DELTA_IN_K=1``; gate/up of
small models, decode steps on the GPU).

    [x | s] @ [W | B]^T = x W^T + s B^T

W gets n * S * R more columns (n slices, S slots, rank R): the columns of slice i, slot j, rank r hold B_i[j][:, r]
in the rows of slice i (zeros in the other slices' rows). x gets the same columns: the norm before the
projection, which computes the shrink s_i = A_i[slot(t)] x_t anyway (``norm_shrink``), writes it (rounded to
x's dtype, as PEFT's bf16 lora_A output is) into its token's slot's columns of each slice and zeros in the
others. One plain GEMM then gives base + delta, rounded once; no expand, no epilogue, and gate/up's activation
is the plain SiLU-and-mul. Why: session 29's critical path (``step_trace.py``, H100, Qwen2.5-0.5B, 8 adapters)
puts 3.4-3.7 µs a layer on gate/up's delta today, and ``bench_decode_linear.py --augmented`` times this at 1.6
µs (0.6 with a K loop that reads only its slice's columns, not built) against today's 3.1 in isolation.

Storage: the wider W is allocated once, when the LoRA wrapper is created (before any CUDA graph is captured),
and the base layer's weight becomes a view of its first K columns (the same numbers, row stride K + n*S*R:
cuBLAS and ``decode_linear`` take it), so the base model costs no more memory and reads no more bytes. B's
columns are written by ``set_lora`` / ``reset_lora`` in place (a captured graph reads the new slot).

Numbers: B rounded to W's dtype (bf16: PEFT's own for a bf16 model; our stacks hold fp16 or fp32) and s rounded
to x's; within the bf16 parity bound, not the bits of the default path.
"""

from __future__ import annotations

import os

import torch

# Off by default until timed in the engine; a module attribute
ENABLED = os.environ.get("LORASERVE_DELTA_IN_K", "0") == "1"
MAX_K = 1536  # the hidden sizes where it is taken (gated_lora.GATED_MAX_K's small models; Llama-8B's gate_up: 5.6 vs 5.1 µs)


def applies(weight: torch.Tensor, lora_b_stacked: tuple[torch.Tensor, ...], tp_size: int) -> bool:
    """Whether a layer of this base weight (N, K) and B stacks (S, 1, N_i, R) per slice takes its delta as more K."""
    return (
        ENABLED
        and weight.is_cuda
        and tp_size == 1
        and weight.dim() == 2
        and weight.dtype in (torch.float16, torch.bfloat16)
        and weight.shape[1] <= MAX_K
        and weight.is_contiguous()
        and sum(b.shape[2] for b in lora_b_stacked) == weight.shape[0]
    )


def extra_columns(lora_b_stacked: tuple[torch.Tensor, ...]) -> int:
    """n * S * R: the columns past K, slice by slice, slot by slot, rank by rank."""
    S, _, _, R = lora_b_stacked[0].shape
    return len(lora_b_stacked) * S * R


def widen(layer: torch.nn.Module, lora_b_stacked: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The (N, K + n*S*R) weight: W in its first K columns, zeros past them; ``layer.weight`` becomes the view
    of its first K columns (the old storage is freed). Call before any CUDA graph reads the weight."""
    w = layer.weight
    N, K = w.shape
    wide = torch.zeros(N, K + extra_columns(lora_b_stacked), dtype=w.dtype, device=w.device)
    wide[:, :K] = w
    layer.weight.data = wide[:, :K]
    return wide


def write_slot(wide: torch.Tensor, K: int, lora_b_stacked: tuple[torch.Tensor, ...], slot: int) -> None:
    """Slot ``slot``'s B of every slice into its columns (in its slice's rows), rounded to the weight's dtype."""
    S, _, _, R = lora_b_stacked[0].shape
    row = 0
    for i, b in enumerate(lora_b_stacked):
        n = b.shape[2]
        col = K + (i * S + slot) * R
        wide[row : row + n, col : col + R] = b[slot, 0].to(wide.dtype)
        row += n
