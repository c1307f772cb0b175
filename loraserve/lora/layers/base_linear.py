"""Shared machinery of the linear LoRA wrappers: n output slices, each with its own A and B.

Beside A and B a slot may carry PEFT's extras (``set_extras``), kept per slot in (max_loras + 1, out)
fp32 tables whose last row is the identity, so indexing with a token's slot (-1 = base) picks it:
- a bias delta: s * lora_B.bias, plus (replacement bias - base bias) for ``bias="all"/"lora_only"``;
- DoRA: g = m / ||W + s*B*A||_row per output, computed once when the slot is written, and
  y = out + (g - 1) * (out - b) + g * s*B(Ax)  ==  g * (Wx + s*BAx) + b.
"""

from __future__ import annotations

import torch

from loraserve.config import LoRAConfig
from loraserve.forward_context import current_lora_mapping, defer_delta
from loraserve.layers.linear import linear
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces
from loraserve.lora.ops.precision import exact_pieces


class BaseLinearLayerWithLoRA(BaseLayerWithLoRA):
    """Subclasses set: ``input_size`` (A's columns on this rank), ``output_slices`` (B's rows per slice on
    this rank) and ``full_shapes`` (per slice, the unsharded (in, out) an adapter must match)."""

    input_size: int
    output_slices: tuple[int, ...]
    full_shapes: list[tuple[int, int]]

    def __init__(self, base_layer):
        super().__init__()
        self.base_layer = base_layer
        self.tp_rank, self.tp_size = base_layer.tp_rank, base_layer.tp_size
        # (an input, its shrink) computed by the launch that wrote it (fuse_norm, keep_shrunk), taken by the
        # call whose x is that very tensor
        self._shrunk_input: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def n_slices(self) -> int:
        return len(self.output_slices)

    def expected_shapes(self) -> list[tuple[int, int]]:
        return self.full_shapes

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        rank, dtype = lora_config.max_lora_rank, lora_config.resolved_dtype()
        dev = self.base_layer.weight.device
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, 1, rank, self.input_size, dtype=dtype, device=dev) for _ in self.output_slices
        )  # per slice (max_loras, 1, R, in)
        self.lora_b_stacked = tuple(
            torch.zeros(max_loras, 1, n, rank, dtype=dtype, device=dev) for n in self.output_slices
        )  # per slice (max_loras, 1, out, R)
        self.slot_ranks = [0] * max_loras
        self.max_loras = max_loras
        self.bias_delta: torch.Tensor | None = None  # (S + 1, out) fp32, allocated on first use
        self.dora_scale: torch.Tensor | None = None  # (S + 1, out) fp32
        self.slot_has_bias = [False] * max_loras
        self.slot_has_dora = [False] * max_loras
        self._gemm_rows: torch.Tensor | None = None  # (gemm_shrink_rows) built on first use
        # per slot: its A is exactly in W's dtype (every piece past the first zero; zeros are: a reset slot's too). Kept
        # by set_lora here; the sharded column wrappers' own set_lora leaves it alone (nothing reads it for them)
        self.slot_a_exact_in_w = [True] * max_loras

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[index].zero_()
            b[index].zero_()
        self.slot_ranks[index] = 0
        self.slot_a_exact_in_w[index] = True
        self.clear_extras(index)
        self._write_gemm_rows(index)

    def gemm_shrink_rows(self) -> torch.Tensor:
        """A one-slice layer's A, every slot's, as more rows of its weight: (P, S, R, in) in W's dtype, the P
        pieces of ``precision.exact_pieces`` (they sum to A), for a GEMM that computes the shrink as extra
        columns (``row_delta``, ``decode_linear(shrink_into=...)``). Built on first use, then kept in step with
        ``set_lora`` / ``reset_lora`` (in place: a captured CUDA graph reads the new slot). Only the first piece
        (P = 1) where every slot of the step has its A exactly in W's dtype (``a_exact_in_w``): the second is
        zeros there (an adapter saved in bf16 and stored in fp16 for a bf16 model), which the GEMM would read
        for nothing (Qwen2.5-0.5B's down: 1.25 MB a layer at 8 slots of rank 16)."""
        if self._gemm_rows is None:
            (a,) = self.lora_a_stacked
            self._gemm_rows = torch.stack(exact_pieces(a[:, 0], self.base_layer.weight.dtype)).contiguous()
        if len(self._gemm_rows) > 1 and self.a_exact_in_w():
            return self._gemm_rows[:1]
        return self._gemm_rows

    def a_exact_in_w(self) -> bool:
        """Whether every slot of the current step has its A exactly in W's dtype: the mapping's ``a_exact_in_w``
        where set (a CUDA graph's key: it must not look at the slots it was captured for), else each active slot's
        ``slot_a_exact_in_w``."""
        mapping = current_lora_mapping()
        if mapping is None:
            return False
        if mapping.a_exact_in_w is not None:
            return mapping.a_exact_in_w
        return all(self.slot_a_exact_in_w[s] for s in mapping.active_slots)

    def _write_gemm_rows(self, index: int) -> None:
        if self._gemm_rows is not None:
            self._gemm_rows[:, index] = torch.stack(exact_pieces(self.lora_a_stacked[0][index, 0], self._gemm_rows.dtype))

    def slot_has_extras(self, index: int) -> bool:
        return self.slot_has_bias[index] or self.slot_has_dora[index]

    def clear_extras(self, index: int) -> None:
        if self.slot_has_bias[index]:
            self.bias_delta[index].zero_()
            self.slot_has_bias[index] = False
        if self.slot_has_dora[index]:
            self.dora_scale[index].fill_(1.0)
            self.slot_has_dora[index] = False

    def _table(self, fill: float) -> torch.Tensor:
        out = sum(self.output_slices)
        return torch.full((self.max_loras + 1, out), fill, dtype=torch.float32, device=self.base_layer.weight.device)

    def _local_rows(self, full: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """This rank's share of per-output vectors, sliced as B's rows are."""
        cols = self.slice_lora_b([None if v is None else v.reshape(-1, 1) for v in full])
        return [None if v is None else v.reshape(-1) for v in cols]

    def base_bias_slices(self) -> list[torch.Tensor | None]:
        bias = self.base_layer.bias
        if bias is None:
            return [None] * self.n_slices
        return list(bias.float().split(list(self.output_slices)))

    def set_extras(
        self,
        index: int,
        magnitudes: list[torch.Tensor | None],
        lora_biases: list[torch.Tensor | None],
        bias_replacements: list[torch.Tensor | None],
    ) -> None:
        """PEFT's extras for slot ``index`` (after set_lora), each per slice, full (unsharded) size."""
        self.clear_extras(index)
        dev = self.base_layer.weight.device

        def on_device(vs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            # NOTE: the adapter's tensors arrive on the host; the math below meets the slots' device tensors
            return [None if v is None else v.to(dev) for v in vs]

        mags = on_device(self._local_rows(magnitudes))
        lbs = on_device(self._local_rows(lora_biases))
        reps = on_device(self._local_rows(bias_replacements))
        offsets = [sum(self.output_slices[:i]) for i in range(self.n_slices)]
        for i, (m, lb, rep, base_b) in enumerate(zip(mags, lbs, reps, self.base_bias_slices())):
            n, off = self.output_slices[i], offsets[i]
            delta = None
            if lb is not None:
                delta = lb.float()
            if rep is not None:
                if base_b is None:
                    raise ValueError("a replacement bias for a layer without a bias")
                d = rep.float() - base_b
                delta = d if delta is None else delta + d
            if delta is not None:
                if self.bias_delta is None:
                    self.bias_delta = self._table(0.0)
                self.bias_delta[index, off : off + n] = delta
                self.slot_has_bias[index] = True
            if m is not None:
                r = self.slot_ranks[index]
                a = self.lora_a_stacked[i][index, 0, :r].float()
                b = self.lora_b_stacked[i][index, 0, :, :r].float()
                w = self.base_layer.weight[off : off + n].float()
                # NOTE: the norm of W + s*BA per output row, in fp32, once per adapter (PEFT recomputes it per call)
                norm = torch.linalg.norm(w + b @ a, dim=1)
                if self.dora_scale is None:
                    self.dora_scale = self._table(1.0)
                self.dora_scale[index, off : off + n] = m.float() / norm
                self.slot_has_dora[index] = True

    def set_lora(self, index: int, lora_a: LoRAPieces, lora_b: LoRAPieces) -> None:
        self.reset_lora(index)
        a_list = self.slice_lora_a(self.as_slices(lora_a, self.n_slices))
        b_list = self.slice_lora_b(self.as_slices(lora_b, self.n_slices))
        rank = 0
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if a is None:
                continue
            r = a.shape[0]
            self.lora_a_stacked[i][index, 0, :r].copy_(a, non_blocking=True)
            self.lora_b_stacked[i][index, 0, :, :r].copy_(b, non_blocking=True)
            rank = max(rank, r)
        self.slot_ranks[index] = rank
        self.slot_a_exact_in_w[index] = all(a is None or self._exact_in_w(a) for a in a_list)
        self._write_gemm_rows(index)

    def _exact_in_w(self, a: torch.Tensor) -> bool:
        """Whether A, as the stacks store it, is exactly in W's dtype. On the host where the adapter arrives (the
        engine's loads hand its tensors in the storage dtype): a cheap check, no device sync."""
        stored = a.to(self.lora_a_stacked[0].dtype)
        return torch.equal(stored.to(self.base_layer.weight.dtype).to(stored.dtype), stored)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, weight, bias) + the per-token LoRA delta (``apply_lora``'s numbers).

        At decode sizes on the GPU the delta rides in the GEMM's epilogue (the shrink and one GEMM
        launch instead of a GEMM, a shrink and an expand); otherwise, and everywhere else, the GEMM then
        ``apply_lora``.
        """
        if self._fusable():
            y = self.punica_wrapper.linear_with_lora(
                x, weight, bias, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks,
                shrunk=self.take_shrunk(x),
            )  # fmt: skip
            if y is not None:
                return y
        return self.apply_lora(linear(x, weight, bias), x)

    def fuse_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, delta=None):
        """The RMSNorm whose output is this layer's input, run with this layer's LoRA shrink in its launch
        (``RMSNorm``'s ``feeds`` protocol; ``norm_shrink``): the norm's result, or None where this
        step's LoRA would not take the fused decode path (the norm then runs alone). The shrink is kept
        for the call of this layer whose x is the norm's output (``take_shrunk``). ``delta``: x's pending
        LoRA delta (``punica.PendingDelta``), added to x first in the same launch."""
        self._shrunk_input = None
        pw = self.punica_wrapper
        if pw is None or not self._fusable():
            return None
        fused = pw.norm_shrink(
            x, residual, weight, eps, self.lora_a_stacked, self.lora_b_stacked, self.slot_ranks, self.base_layer.weight,
            delta=delta,
        )  # fmt: skip
        if fused is None:
            return None
        out, new_residual, buf = fused
        self._shrunk_input = (out, buf)
        return out if residual is None else (out, new_residual)

    def take_shrunk(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shrink computed by the launch that wrote x (``fuse_norm``, ``keep_shrunk``), if x is the tensor
        it was computed from (once)."""
        pending, self._shrunk_input = self._shrunk_input, None
        return pending[1] if pending is not None and pending[0] is x else None

    def defer_to_reader(self, x: torch.Tensor, deferring) -> torch.Tensor | None:
        """y where ``deferring(shrunk)`` (a punica ``*_deferring_delta`` call given x's shrink from the launch that
        wrote x, or None) returns (y, its delta): the delta is left to y's reader (``forward_context.defer_delta``).
        Else None, with x's shrink kept for the fused path of ``linear``."""
        shrunk = self.take_shrunk(x)
        deferred = deferring(shrunk)
        if deferred is not None:
            y, delta = deferred
            defer_delta(y, delta)
            return y
        if shrunk is not None:
            self.keep_shrunk(x, shrunk)
        return None

    def keep_shrunk(self, x: torch.Tensor, buf: torch.Tensor) -> None:
        """Keep the shrink of x that the launch writing x computed, for ``take_shrunk``."""
        self._shrunk_input = (x, buf)

    def _fusable(self) -> bool:
        """Whether this step's LoRA may take a kernel path that fuses it with the GEMM (the punica
        wrapper's ``linear_with_lora`` and the like): a kernel backend, adapters in the batch, one rank,
        and no active slot with PEFT's extras (bias, DoRA), which only ``apply_lora`` knows."""
        mapping = current_lora_mapping()
        pw = self.punica_wrapper
        if pw is None or not pw.fuses_linear or mapping is None or not mapping.has_lora or self.tp_size != 1:
            return False
        return not any(self.slot_has_bias[s] or self.slot_has_dora[s] for s in mapping.active_slots)

    def forward_activated(self, x: torch.Tensor, act) -> torch.Tensor:
        """act(self(x)): a gated MLP's projection and activation (``MergedColumnParallelLinear``'s
        contract); wrappers with a fused path for it override this."""
        return act(self(x))

    def apply_lora(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + per-token LoRA delta, accumulated in fp32 and rounded once (PEFT's non-mixed path)."""
        mapping = current_lora_mapping()
        if mapping is None or not mapping.has_lora:
            return out
        active = mapping.active_slots
        has_bias = any(self.slot_has_bias[s] for s in active)
        has_dora = any(self.slot_has_dora[s] for s in active)
        if has_bias or has_dora:
            return self._apply_with_extras(out, x, mapping, has_bias, has_dora)
        return self.punica_wrapper.apply_lora_linear(
            out, x, self.lora_a_stacked, self.lora_b_stacked, self.output_slices, self.slot_ranks
        )

    def _apply_with_extras(self, out, x, mapping, has_bias: bool, has_dora: bool) -> torch.Tensor:
        acc = out.float()
        slots = mapping.token_slots  # -1 picks the identity row
        bias = self.bias_delta[slots] if has_bias else None  # (T, out)
        if bias is not None:
            acc = acc + bias
        if not has_dora:
            self.punica_wrapper.add_lora_linear(
                acc, x, self.lora_a_stacked, self.lora_b_stacked, self.output_slices, self.slot_ranks
            )
            return acc.to(out.dtype)
        delta = torch.zeros_like(acc)
        self.punica_wrapper.add_lora_linear(
            delta, x, self.lora_a_stacked, self.lora_b_stacked, self.output_slices, self.slot_ranks
        )
        g = self.dora_scale[slots]
        b = self.base_layer.bias.float() if self.base_layer.bias is not None else torch.zeros_like(acc[0])
        if bias is not None:
            b = b + bias
        return (acc + (g - 1) * (acc - b) + g * delta).to(out.dtype)
