"""LoRA on MoE experts: per-(slot, expert) A and B on w13 and w2, inside each expert's computation.

PEFT's ``target_parameters`` semantics (reference §3.6): W_e += s * B_e A_e for every expert e, so the
w13 delta joins expert e's gate/up output before the activation, and the w2 delta its down output
before the routing weight. Slices: gated experts have three (gate, up, down), non-gated two (up, down);
each slot holds per slice A ``(max_loras, E, R, in)`` and B ``(max_loras, E, out, R)`` (padded rank).

Adapters come in two layouts (``gather_adapter``):
- PEFT ``target_parameters`` (3-D, parsed by peft.py into A (E, r, H), B (E, 2I, r)): gate and up share
  A; B's rows split by the base layout, [gate; up] or interleaved [g0, u0, g1, ...] (GPT-OSS);
- per-expert 2-D modules, ``<experts>.N.gate_proj / up_proj / down_proj`` or Mixtral's v4
  ``block_sparse_moe.experts.N.w1 / w3 / w2``: stacked, each expert with its own r (zero-padded).

TP follows the base layer: w13 slices B by output (each of gate/up on its own), w2 slices A by input;
the w2 delta joins the partial sum before the all-reduce. ``adapter_enabled[slot]`` says whether the
slot carries LoRA on these experts; tokens of other slots take the base path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraserve.config import LoRAConfig
from loraserve.forward_context import current_lora_mapping
from loraserve.layers.moe import FusedMoE
from loraserve.lora.errors import LoRAShapeError, LoRAUnsupportedFeatureError
from loraserve.lora.layers.base import BaseLayerWithLoRA, LoRAPieces
from loraserve.lora.ops.precision import compute_dtype
from loraserve.lora.ops.torch_ops import matmul_t
from loraserve.lora.peft import LoRAModuleWeights

# per-expert 2-D module names of each slice: HF v4 / Qwen names first, then Mixtral's
_PER_EXPERT_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


class FusedMoEWithLoRA(BaseLayerWithLoRA):
    def __init__(self, base_layer: FusedMoE):
        super().__init__()
        self.base_layer = base_layer
        self.tp_rank, self.tp_size = base_layer.tp_rank, base_layer.tp_size
        H, inter, il = (
            base_layer.hidden_size,
            base_layer.intermediate_size,
            base_layer.intermediate_per_partition,
        )
        n13 = 2 if base_layer.gated else 1
        self.slice_names = ("gate", "up", "down")[-(n13 + 1) :]
        self.n13 = n13
        self.input_sizes = (H,) * n13 + (il,)  # A's columns per slice, this rank
        self.output_slices = (il,) * n13 + (H,)  # B's rows per slice, this rank
        self.full_shapes = [(H, inter)] * n13 + [(inter, H)]

    @property
    def n_slices(self) -> int:
        return len(self.slice_names)

    def expected_shapes(self) -> list[tuple[int, int]]:
        return self.full_shapes

    def create_lora_weights(self, max_loras: int, lora_config: LoRAConfig, model_config=None) -> None:
        rank, dtype = lora_config.max_lora_rank, lora_config.resolved_dtype()
        E, dev = self.base_layer.num_experts, self.base_layer.gate_up_proj.device
        self.lora_a_stacked = tuple(
            torch.zeros(max_loras, E, rank, n, dtype=dtype, device=dev) for n in self.input_sizes
        )  # per slice (max_loras, E, R, in)
        self.lora_b_stacked = tuple(
            torch.zeros(max_loras, E, n, rank, dtype=dtype, device=dev) for n in self.output_slices
        )  # per slice (max_loras, E, out, R)
        self.max_loras = max_loras
        self.slot_ranks = [0] * max_loras
        self.adapter_enabled = [False] * max_loras

    def reset_lora(self, index: int) -> None:
        for a, b in zip(self.lora_a_stacked, self.lora_b_stacked):
            a[index].zero_()
            b[index].zero_()
        self.slot_ranks[index] = 0
        self.adapter_enabled[index] = False

    def slice_lora_a(self, lora_a):
        """w13 A whole; w2 A (E, r, I) sliced by input."""
        il = self.base_layer.intermediate_per_partition
        *w13, down = lora_a
        return [*w13, None if down is None else down.narrow(2, self.tp_rank * il, il)]

    def slice_lora_b(self, lora_b):
        """w13 B (E, I, r) sliced by output, gate and up each on its own; w2 B whole."""
        il = self.base_layer.intermediate_per_partition
        *w13, down = lora_b
        return [None if b is None else b.narrow(1, self.tp_rank * il, il) for b in w13] + [down]

    def set_lora(self, index: int, lora_a: LoRAPieces, lora_b: LoRAPieces) -> None:
        """Per slice (gate, up, down or up, down): A (E, r, in) and B (E, out, r), full size; None = zeros."""
        self.reset_lora(index)
        a_list = self.slice_lora_a(self.as_slices(lora_a, self.n_slices))
        b_list = self.slice_lora_b(self.as_slices(lora_b, self.n_slices))
        rank = 0
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            if a is None:
                continue
            r = a.shape[1]
            self.lora_a_stacked[i][index, :, :r].copy_(a, non_blocking=True)
            self.lora_b_stacked[i][index, :, :, :r].copy_(b, non_blocking=True)
            rank = max(rank, r)
        self.slot_ranks[index] = rank
        self.adapter_enabled[index] = rank > 0

    def gather_adapter(
        self, modules: dict[str, LoRAModuleWeights], pieces: list[str | None], where: Callable[[str], str]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[str]]:
        """This layer's share of an adapter: per slice A (E, r, in) and B (E, out, r) (full size, None = none),
        and the adapter module names used. ``pieces``: the parameter paths (``<experts>.gate_up_proj``,
        ``<experts>.down_proj``); None = excluded by lora_target_modules."""
        base = self.base_layer
        E, inter = base.num_experts, base.intermediate_size
        n = self.n_slices
        a_out: list[torch.Tensor | None] = [None] * n
        b_out: list[torch.Tensor | None] = [None] * n
        used: list[str] = []
        for j, name in enumerate(pieces):
            w = modules.get(name) if name is not None else None
            if w is None:
                continue
            # w13: (H, 2I) for gated experts, (H, I) otherwise; w2: (I, H)
            a_cols, b_rows = (
                (self.full_shapes[0][0], self.full_shapes[0][1] * self.n13)
                if j == 0
                else self.full_shapes[-1]
            )
            if (
                w.num_experts == 0
                or tuple(w.lora_a.shape[::2]) != (E, a_cols)
                or tuple(w.lora_b.shape[:2]) != (E, b_rows)
            ):
                raise LoRAShapeError(
                    f"{where(name)}: expert LoRA A{tuple(w.lora_a.shape)} B{tuple(w.lora_b.shape)} does not fit "
                    f"{E} experts of (in, out) = ({a_cols}, {b_rows}) as (E, r, in), (E, out, r); "
                    f"was the adapter trained for another base model?"
                )
            if j == 1:
                a_out[-1], b_out[-1] = w.lora_a, w.lora_b
            elif self.n13 == 1:
                a_out[0], b_out[0] = w.lora_a, w.lora_b
            else:  # split B's rows as the base layout packs gate and up
                rows = (
                    (slice(0, 2 * inter, 2), slice(1, 2 * inter, 2))
                    if base.interleaved
                    else (slice(0, inter), slice(inter, 2 * inter))
                )
                for i, rs in enumerate(rows):
                    a_out[i], b_out[i] = w.lora_a, w.lora_b[:, rs]
            used.append(name)
        prefix = next(p for p in pieces if p is not None).rpartition(".")[0]  # '<...>.mlp.experts'
        prefixes = [prefix]
        if prefix.endswith(".mlp.experts"):  # Mixtral adapters trained on transformers 4
            prefixes.append(prefix[: -len(".mlp.experts")] + ".block_sparse_moe.experts")
        for i, slice_name in enumerate(self.slice_names):
            if pieces[0 if i < self.n13 else 1] is None:
                continue
            names = _PER_EXPERT_NAMES[slice_name] if self.n13 == 2 or slice_name == "down" else ("up_proj",)
            found: dict[int, tuple[str, LoRAModuleWeights]] = {}
            for e in range(E):
                for key in (f"{p}.{e}.{nm}" for p in prefixes for nm in names):
                    if key in modules:
                        if e in found:
                            raise LoRAShapeError(
                                f"{where(key)}: expert {e} has LoRA under two names ({found[e][0]!r})"
                            )
                        found[e] = (key, modules[key])
            if not found:
                continue
            if a_out[i] is not None:
                raise LoRAShapeError(
                    f"{where(next(iter(found.values()))[0])}: the adapter has both per-expert and "
                    f"target_parameters LoRA for the same experts"
                )
            in_f, out_f = self.full_shapes[i]
            r = max(w.rank for _, w in found.values())
            ref = next(iter(found.values()))[1].lora_a
            a3 = torch.zeros(E, r, in_f, dtype=ref.dtype)
            b3 = torch.zeros(E, out_f, r, dtype=ref.dtype)
            for e, (key, w) in found.items():
                if (
                    w.is_embedding
                    or w.lora_a.dim() != 2
                    or w.lora_a.shape[1] != in_f
                    or w.lora_b.shape[0] != out_f
                ):
                    raise LoRAShapeError(
                        f"{where(key)}: LoRA shapes A{tuple(w.lora_a.shape)} B{tuple(w.lora_b.shape)} do not fit the "
                        f"expert (in, out) = ({in_f}, {out_f}); was the adapter trained for another base model?"
                    )
                if w.magnitude is not None or w.lora_bias is not None:
                    raise LoRAUnsupportedFeatureError(
                        f"{where(key)}: DoRA or lora_bias on MoE experts is not supported yet"
                    )
                a3[e, : w.rank] = w.lora_a
                b3[e, :, : w.rank] = w.lora_b
                used.append(key)
            a_out[i], b_out[i] = a3, b3
        return a_out, b_out, used

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        mapping = current_lora_mapping()
        # NOTE: a static mapping (CUDA graphs) serves whatever adapters later replays bring: the LoRA
        # path must be captured even if no slot has expert LoRA now (else later deltas are dropped)
        static = mapping is not None and mapping.token_meta is not None and mapping.token_meta.static
        if mapping is None or (not static and not any(self.adapter_enabled[s] for s in mapping.active_slots)):
            return base(x, router_logits)
        weights, ids = base.select_experts(router_logits)
        if base.use_triton(x):
            from loraserve.layers.triton_moe import fused_experts  # NOTE: lazy: CPU installs have no triton

            hook = _TritonExpertLoRAHook(self, mapping.token_slots, self._ranks_on(x.device))
            return base.finish(fused_experts(base, x, weights, ids, hook=hook))
        T, k = ids.shape
        S, E = self.max_loras, base.num_experts
        enabled = torch.tensor(self.adapter_enabled + [False], device=x.device)  # index -1 = base
        slots = mapping.token_slots.repeat_interleave(k)  # (T*k,) slot of each assignment
        slots = torch.where(enabled[slots], slots, -1)
        key = ids.reshape(-1) * (S + 1) + slots + 1  # (T*k,) grouped by expert, then slot (base first)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=E * (S + 1)).view(E, S + 1).tolist()
        hook = _ExpertLoRAHook(self, counts)
        return base.finish(base.experts_forward(x, weights, ids, hook=hook, order=order))

    def _ranks_on(self, device: torch.device) -> torch.Tensor:
        """The per-slot ranks as int32 on the device: the punica kernels' copy (refreshed before every
        CUDA-graph replay) when there is one, else a fresh copy."""
        kernels = self.punica_wrapper.kernels if self.punica_wrapper is not None else None
        if kernels is not None and hasattr(kernels, "ranks_tensor"):
            return kernels.ranks_tensor(self.slot_ranks)
        return torch.tensor(self.slot_ranks, dtype=torch.int32).to(device)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None) -> bool:
        return isinstance(source_layer, FusedMoE)


class _TritonExpertLoRAHook:
    """The GPU hook of ``fused_experts``: the assignments of tokens whose slot has LoRA here, aligned by
    (slot, expert), then per projection one shrink and one expand launch for all its slices. Slots
    without LoRA (rank 0) and base tokens (slot -1) are excluded on the device: no host sync."""

    def __init__(self, layer: FusedMoEWithLoRA, token_slots: torch.Tensor, ranks: torch.Tensor):
        self.layer = layer
        self.token_slots = token_slots  # (T,) long, -1 = base
        self.ranks = ranks  # (S,) int32
        self._blocks = None

    def blocks(self, ids: torch.Tensor):
        from loraserve.layers.moe_align import align_by_group, pick_block_m

        if self._blocks is None:
            T, k = ids.shape
            S, E = self.layer.max_loras, self.layer.base_layer.num_experts
            slots = self.token_slots[:, None].expand(T, k).reshape(-1)  # (T*k,) slot of each assignment
            has_lora = torch.cat([self.ranks > 0, self.ranks.new_zeros(1, dtype=torch.bool)])  # [S] = base
            use = has_lora[torch.where(slots >= 0, slots, S)]
            groups = torch.where(use, slots.clamp(min=0) * E + ids.reshape(-1), S * E)
            self._blocks = align_by_group(groups, S * E, pick_block_m(T * k, S * E))
        return self._blocks

    def w13(self, h: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> None:
        from loraserve.lora.ops.triton.fused_moe_lora import moe_lora_expand, moe_lora_shrink

        layer, base = self.layer, self.layer.base_layer
        blocks, n13 = self.blocks(ids), layer.n13
        buf = moe_lora_shrink(x, layer.lora_a_stacked[:n13], blocks, self.ranks, token_div=ids.shape[1])
        il = base.intermediate_per_partition
        offsets, stride = ((0, 1), 2) if base.interleaved else (tuple(i * il for i in range(n13)), 1)
        moe_lora_expand(h, buf, layer.lora_b_stacked[:n13], blocks, self.ranks, offsets, stride, x.dtype)

    def w2(self, y: torch.Tensor, a: torch.Tensor, ids: torch.Tensor) -> None:
        from loraserve.lora.ops.triton.fused_moe_lora import moe_lora_expand, moe_lora_shrink

        layer, blocks = self.layer, self.blocks(ids)
        buf = moe_lora_shrink(a, layer.lora_a_stacked[-1:], blocks, self.ranks, token_div=1)
        moe_lora_expand(y, buf, layer.lora_b_stacked[-1:], blocks, self.ranks, (0,), 1, a.dtype)


class _ExpertLoRAHook:
    """Adds each slot's LoRA delta inside expert e's computation. Within an expert the tokens arrive grouped
    by slot (base tokens first), so every (expert, slot) pair is one contiguous row range: one matmul pair
    per pair and slice, sized by the slot's rank. fp32 accumulate, one rounding (PEFT's fp32 LoRA path)."""

    def __init__(self, layer: FusedMoEWithLoRA, counts: list[list[int]]):
        self.layer = layer
        self.counts = counts  # (E, S + 1): assignments per (expert, slot + 1)

    def _segments(self, e: int) -> list[tuple[int, int, int]]:
        row = self.counts[e]
        segs, pos = [], row[0]
        for s, c in enumerate(row[1:]):
            if c:
                segs.append((s, pos, c))
                pos += c
        return segs

    def _add(
        self, e: int, inp: torch.Tensor, out: torch.Tensor, slices: list[tuple[int, slice]]
    ) -> torch.Tensor:
        segs = self._segments(e)
        if not segs:
            return out
        layer = self.layer
        acc = out.float()
        for s, pos, c in segs:
            r = layer.slot_ranks[s]
            xs = inp[pos : pos + c]  # (c, in)
            for i, cols in slices:
                a = layer.lora_a_stacked[i][s, e, :r]  # (r, in)
                b = layer.lora_b_stacked[i][s, e, :, :r]  # (out, r)
                cdt = compute_dtype(xs.dtype, a.dtype)  # precision.py: the kernels' products
                acc[pos : pos + c, cols] += matmul_t(matmul_t(xs, a, cdt), b, cdt)
        return acc.to(out.dtype)

    def w13(self, e: int, tok: torch.Tensor, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        base = self.layer.base_layer
        return self._add(e, x, h, [(i, base.w13_rows(i)) for i in range(self.layer.n13)])

    def w2(self, e: int, tok: torch.Tensor, a: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._add(e, a, y, [(self.layer.n13, slice(None))])
