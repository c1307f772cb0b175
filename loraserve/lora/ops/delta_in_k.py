"""gate/up's LoRA delta as more K of its base GEMM (small models, decode steps on the GPU).

    y[rows of slice i] = [x | s_i] @ [W | B_i]^T = x W^T + s_i B_i^T

W gets S * R more columns (S slots, rank R): column K + j*R + r holds, in the rows of slice i (gate, up),
B_i[j][:, r]. x gets n * S * R more: the norm before the projection, which computes the shrink s_i =
A_i[slot(t)] x_t anyway (``norm_shrink(in_k=True)``), writes s_i (rounded to x's dtype, as PEFT's bf16 lora_A
output is) into column K + (i*S + j)*R + r where j is its token's slot, zeros in the other slots'. The decode
GEMM reads, for the rows of slice i, x's set of slice i past K (``decode_linear(in_k=...)``: the rows of the
second slice read x's columns past K S*R further on). One GEMM then gives base + delta, rounded once: no
expand, no epilogue, and gate/up's activation is the plain SiLU-and-mul.

Why: on Qwen2.5-0.5B (H100, 8 adapters) the critical path (``step_trace.py``) had 3.4-3.7 µs a layer on gate/up's
delta; ``bench_decode_linear.py --augmented`` times 128 more columns at 0.6 µs alone. Measured in the engine (H100,
step_trace's graph replay): 1.140 -> 1.123 ms (base 0.960), and 1.143 -> 1.111 with the norms' folded shrink
(``norm_shrink``). NOTE: a plain form, 256 more columns of W (a GEMM over every slice's set), was slower (1.141 ->
1.153 ms: the GEMM +3.3 µs and the norm about +1) and was removed.

Storage: the wider W is allocated once, when the LoRA wrapper is created (before any CUDA graph is captured),
and the base layer's weight becomes a view of its first K columns (the same numbers, row stride K + S*R:
cuBLAS and ``decode_linear`` take it), so the base model costs no more memory and reads no more bytes. B's
columns are written by ``set_lora`` / ``reset_lora`` in place (a captured graph reads the new slot).

Numbers: B rounded to W's dtype (bf16: PEFT's own for a bf16 model; our stacks hold fp16 or fp32) and s rounded
to x's; within the bf16 parity bound, not the bits of the default path.
"""

from __future__ import annotations

import torch

MAX_K = 1536  # the hidden sizes where it is taken (gated_lora.GATED_MAX_K's small models; Llama-8B's gate_up: 5.6 vs 5.1 µs)
# S * R up to which it is taken: the GEMM reads every slot's columns whatever ranks a step uses, so its cost grows with
# the slots (256 columns, the plain form's, measured slower); 128 is what was measured faster (8 x 16)
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
    """Whether a layer takes its delta as more K: on the GPU, one rank, not the fully sharded wrappers (their own
    set_lora), and shapes that ``fits``."""
    return weight.is_cuda and tp_size == 1 and not sharded and fits(weight, lora_b_stacked)


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
            "would add to every token's product: a float16 model can serve it with --dtype bfloat16; NaN or inf "
            "means the adapter file is broken"
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
