"""gate/up's LoRA delta as more K of its base GEMM (on by default since session 30, ``LORASERVE_DELTA_IN_K=0`` turns
it off; small models, decode steps on the GPU).

    y[rows of slice i] = [x | s_i] @ [W | B_i]^T = x W^T + s_i B_i^T

W gets S * R more columns (S slots, rank R): column K + j*R + r holds, in the rows of slice i (gate, up),
B_i[j][:, r]. x gets n * S * R more: the norm before the projection, which computes the shrink s_i =
A_i[slot(t)] x_t anyway (``norm_shrink(in_k=True)``), writes s_i (rounded to x's dtype, as PEFT's bf16 lora_A
output is) into column K + (i*S + j)*R + r where j is its token's slot, zeros in the other slots'. The decode
GEMM reads, for the rows of slice i, x's set of slice i past K (``decode_linear(in_k=...)``: the rows of the
second slice read x's columns past K S*R further on). One GEMM then gives base + delta, rounded once: no
expand, no epilogue, and gate/up's activation is the plain SiLU-and-mul.

Why: session 29's critical path (``step_trace.py``, H100, Qwen2.5-0.5B, 8 adapters) puts 3.4-3.7 µs a layer on
gate/up's delta today; ``bench_decode_linear.py --augmented`` times 128 more columns at 0.6 µs alone (256, a
plain GEMM over every slice's set, at 1.6) against today's 3.1. Measured in the engine (session 29) in the
plain form, 256 more columns of W: slower, 1.141-1.144 -> 1.153 ms (the SiLU-and-mul's +3.5 µs in the layer's
critical path gone, but the GEMM +3.3 and the norm about +1); parity vs HF + PEFT 0.0118 (the default 0.0087).
This form (128 more columns), measured (session 30, H100, one call each, step_trace's graph replay): 1.140 -> 1.123 ms
(base 0.960), and with the norms' folded shrink (``norm_shrink.FOLD``) 1.143 -> 1.111 (base 0.961-0.963), then with
the vocab deltas skipped (``VocabExtras.adds_delta``) 1.101 -> 1.075 (base 0.961-0.964): on by default since.

Storage: the wider W is allocated once, when the LoRA wrapper is created (before any CUDA graph is captured),
and the base layer's weight becomes a view of its first K columns (the same numbers, row stride K + S*R:
cuBLAS and ``decode_linear`` take it), so the base model costs no more memory and reads no more bytes. B's
columns are written by ``set_lora`` / ``reset_lora`` in place (a captured graph reads the new slot).

Numbers: B rounded to W's dtype (bf16: PEFT's own for a bf16 model; our stacks hold fp16 or fp32) and s rounded
to x's; within the bf16 parity bound, not the bits of the default path.
"""

from __future__ import annotations

import os

import torch

# On by default (measured faster, above); a module attribute
ENABLED = os.environ.get("LORASERVE_DELTA_IN_K", "1") != "0"
MAX_K = 1536  # the hidden sizes where it is taken (gated_lora.GATED_MAX_K's small models; Llama-8B's gate_up: 5.6 vs 5.1 µs)
# S * R up to which it is taken: the GEMM reads every slot's columns whatever ranks a step uses, so its cost grows with
# the slots (256 columns, the first form's, measured slower: session 29); 128 is what was measured faster (8 x 16)
MAX_SLOT_COLUMNS = 128
# The decode GEMM's K step and its largest column block (triton_decode_linear.default_tiles: 128 each)
K_STEP = 128


def fits(weight: torch.Tensor, lora_b_stacked: tuple[torch.Tensor, ...]) -> bool:
    """Whether this base weight (N, K) and two slices' B stacks (S, 1, N_i, R) have the shapes the path takes: half
    precision, K at most MAX_K and a multiple of the decode GEMM's K step (the second slice's columns start on a
    step), each slice a multiple of its largest column block (a block never straddles the two slices), S * R at
    most MAX_SLOT_COLUMNS."""
    return (
        len(lora_b_stacked) == 2
        and slot_columns(lora_b_stacked) <= MAX_SLOT_COLUMNS
        and weight.dim() == 2
        and weight.dtype in (torch.float16, torch.bfloat16)
        and weight.is_contiguous()
        and weight.shape[1] <= MAX_K
        and weight.shape[1] % K_STEP == 0
        and all(b.shape[2] % K_STEP == 0 for b in lora_b_stacked)
        and sum(b.shape[2] for b in lora_b_stacked) == weight.shape[0]
    )


def applies(weight: torch.Tensor, lora_b_stacked: tuple[torch.Tensor, ...], tp_size: int, sharded: bool) -> bool:
    """Whether a layer takes its delta as more K: on (ENABLED), on the GPU, one rank, not the fully sharded wrappers
    (their own set_lora), and shapes that ``fits``."""
    return ENABLED and weight.is_cuda and tp_size == 1 and not sharded and fits(weight, lora_b_stacked)


def slot_columns(lora_b_stacked: tuple[torch.Tensor, ...]) -> int:
    """S * R: W's columns past K (slot by slot, rank by rank); x has that many per slice."""
    S, _, _, R = lora_b_stacked[0].shape
    return S * R


def widen(layer: torch.nn.Module, lora_b_stacked: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The (N, K + S*R) weight: W in its first K columns, zeros past them; ``layer.weight`` becomes the view
    of its first K columns (the old storage is freed). Call before any CUDA graph reads the weight."""
    w = layer.weight
    N, K = w.shape
    wide = torch.zeros(N, K + slot_columns(lora_b_stacked), dtype=w.dtype, device=w.device)
    wide[:, :K] = w
    layer.weight.data = wide[:, :K]
    return wide


def refuse_past_range(lora_b: list[torch.Tensor | None], stack_dtype: torch.dtype, w_dtype: torch.dtype, slot: int) -> None:
    """Raise ValueError where a slice's B (as ``set_lora`` receives it: on the host for the engine's loads, so no
    device sync), stored in ``stack_dtype`` and rounded to W's, holds a value past W's dtype (or not finite). Every
    token's product reads every slot's columns (times zeros where the slot is not its own): such a value would reach
    every request, where the default path keeps it to the adapter's own tokens."""
    if not all(b is None or torch.isfinite(b.to(stack_dtype).to(w_dtype)).all() for b in lora_b):
        raise ValueError(
            f"slot {slot}: a LoRA B value is past {w_dtype}'s range (or not finite), which gate/up's delta as more K "
            "would add to every token's product: serve this adapter with LORASERVE_DELTA_IN_K=0"
        )


def write_slot(wide: torch.Tensor, K: int, lora_b_stacked: tuple[torch.Tensor, ...], slot: int) -> None:
    """Slot ``slot``'s B of every slice into its columns, in that slice's rows, rounded to the weight's dtype
    (``refuse_past_range`` checked them first)."""
    R = lora_b_stacked[0].shape[3]
    rounded = [b[slot, 0].to(wide.dtype) for b in lora_b_stacked]
    row, col = 0, K + slot * R
    for r in rounded:
        wide[row : row + r.shape[0], col : col + R] = r
        row += r.shape[0]


def gemm_args(K: int, lora_b_stacked: tuple[torch.Tensor, ...]) -> tuple[int, int, int]:
    """``decode_linear``'s ``in_k``: from column K on, the second slice's rows read x S*R columns further on."""
    return K, lora_b_stacked[0].shape[2], slot_columns(lora_b_stacked)


def reference(x_wide: torch.Tensor, wide: torch.Tensor, K: int, lora_b_stacked: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The product the decode GEMM computes with ``gemm_args``, in torch (fp32): each slice's rows times x's first
    K columns and that slice's set past them."""
    SR, out, row = slot_columns(lora_b_stacked), [], 0
    for i, b in enumerate(lora_b_stacked):
        n = b.shape[2]
        xi = torch.cat([x_wide[:, :K], x_wide[:, K + i * SR : K + (i + 1) * SR]], dim=1).float()
        out.append(xi @ wide[row : row + n].float().T)
        row += n
    return torch.cat(out, dim=1)
