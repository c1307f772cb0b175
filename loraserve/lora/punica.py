"""The batch's LoRA mapping and the wrapper that applies it (Punica / S-LoRA style).

``LoRAMapping`` is built once per forward by the LoRA manager and travels in the forward context:
per-token slot (-1 = base), tokens sorted by slot as segments, the same for the logits rows.
``PunicaWrapper`` is what layers call (``add_lora_linear`` / ``add_lora_embedding`` /
``add_lora_logits``); it reads the current mapping from the context and dispatches to the backend
ops, chosen once at construction (torch reference on CPU, Triton kernels on CUDA when available).
On CUDA the mapping also carries ``SegmentMeta``: the same segments as one int32 device tensor.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from loraserve.forward_context import current_lora_mapping
from loraserve.lora.ops import torch_ops
from loraserve.lora.ops.precision import compute_dtype


def _segments(
    slots: torch.Tensor, device: torch.device
) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    """slots (T,) on the CPU -> (segments [(slot, indices on device)], order on device, order on the CPU,
    starts, lens, seg_slots) over tokens sorted by slot (>= 0 only).

    NOTE: computed on the host from the host copy: no device round trip (the GPU never syncs here).
    """
    order_cpu = torch.argsort(slots, stable=True)
    uniq, counts = torch.unique_consecutive(slots[order_cpu], return_counts=True)
    order = order_cpu.to(device)
    segs, starts, lens, seg_slots = [], [], [], []
    pos = 0
    for s, c in zip(uniq.tolist(), counts.tolist()):
        if s >= 0:
            segs.append((s, order[pos : pos + c]))
            starts.append(pos)
            lens.append(c)
            seg_slots.append(s)
        pos += c
    return segs, order, order_cpu, starts, lens, seg_slots


@dataclass
class SegmentMeta:
    """The segments as one int32 device tensor, for the GPU kernels (one host->device copy per mapping).

    ``packed`` = [order (T,) | seg_slot (S,) | seg_start (S,) | seg_len (S,)]. A static meta (CUDA
    graphs) has S = max_loras and unused segments of length 0, which the kernels skip.
    """

    packed: torch.Tensor
    num_tokens: int
    num_segs: int
    max_seg_len: int
    static: bool = False

    @classmethod
    def build(
        cls,
        order: torch.Tensor,
        seg_slots: list[int],
        starts: list[int],
        lens: list[int],
        device: torch.device,
    ) -> SegmentMeta:
        """From the host copy of the order (CPU tensor): one host->device copy, no sync."""
        host = torch.tensor(order.tolist() + seg_slots + starts + lens, dtype=torch.int32)
        return cls(host.to(device), len(order), len(seg_slots), max(lens, default=0))

    @staticmethod
    def static_host(slots: list[int], num_tokens: int, max_loras: int) -> list[int]:
        """The packed contents for a static meta of ``num_tokens`` rows (``slots`` may be shorter: the
        rest is padding): every slot has a segment, in slot order, empty ones of length 0."""
        counts = [0] * max_loras
        for s in slots:
            if s >= 0:
                counts[s] += 1
        starts, pos = [], 0
        for c in counts:
            starts.append(pos)
            pos += c
        order = sorted((t for t, s in enumerate(slots) if s >= 0), key=lambda t: slots[t])
        order += [0] * (num_tokens - len(order))
        return order + list(range(max_loras)) + starts + counts


@dataclass
class LoRAMapping:
    token_slots: torch.Tensor  # (T,) long, -1 = base model
    logit_slots: torch.Tensor  # (R,) long, for the rows whose logits are computed
    token_segments: list[tuple[int, torch.Tensor]]
    logit_segments: list[tuple[int, torch.Tensor]]
    token_order: torch.Tensor  # (T,) token indices sorted by slot
    seg_starts: list[int]
    seg_lens: list[int]
    token_meta: SegmentMeta | None = None  # the kernels' view (CUDA only)
    logit_meta: SegmentMeta | None = None
    # Whether the embedding's and lm_head's A/B deltas run (``VocabExtras.adds_delta``). None: each of them looks at
    # its active slots' ranks on the host (an eager step). A CUDA graph sets it, part of its key: the graph must not
    # look at the slots of the step it was captured for
    vocab_lora: bool | None = None
    # Whether every slot of the step has its A exactly in the base weight's dtype (``BaseLinearLayerWithLoRA.
    # gemm_shrink_rows``: one piece). None: each layer looks at its active slots; a CUDA graph sets it (its key)
    a_exact_in_w: bool | None = None

    @classmethod
    def build(cls, token_slots: list[int], logit_slots: list[int], device: torch.device) -> LoRAMapping:
        ts = torch.tensor(token_slots, dtype=torch.long)
        ls = torch.tensor(logit_slots, dtype=torch.long)
        tseg, order, order_cpu, starts, lens, tslots = _segments(ts, device)
        lseg, _, lorder_cpu, lstarts, llens, lslots = _segments(ls, device)
        tmeta = lmeta = None
        if device.type == "cuda":
            tmeta = SegmentMeta.build(order_cpu, tslots, starts, lens, device)
            lmeta = SegmentMeta.build(lorder_cpu, lslots, lstarts, llens, device)
        return cls(ts.to(device), ls.to(device), tseg, lseg, order, starts, lens, tmeta, lmeta)

    @property
    def has_lora(self) -> bool:
        return bool(self.token_segments)

    @property
    def has_logits_lora(self) -> bool:
        return bool(self.logit_segments)

    @property
    def active_slots(self) -> list[int]:
        return [s for s, _ in self.token_segments]


def _select_backend(device: torch.device):
    """torch reference ops on the CPU; the Triton kernels on CUDA when Triton is installed."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from loraserve.lora.ops.triton_ops import TritonLoRAOps  # NOTE: lazy: CPU installs have no triton

        return TritonLoRAOps(device)
    return None


def _delta_of_slots(s: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """(T, N) fp32 = B[slot] s per token, s (T, R) fp32 rounded to the products' dtype as the kernels round it;
    zeros for base tokens (slot -1), whatever their s rows hold. The torch path of a deferred delta's reader."""
    cdt = compute_dtype(act_dtype, lora_b.dtype)
    b = lora_b[slots.clamp(min=0), 0].to(cdt).float()  # (T, N, R)
    s = torch.where((slots >= 0)[:, None], s, 0.0).to(cdt).float()
    return torch.einsum("tnr,tr->tn", b, s)


class PendingDelta(NamedTuple):
    """A row-parallel projection's LoRA delta left to the RMSNorm that reads its output (``row_delta``):
    the shrink of its input (buf (P, 1, T, R) fp32, every column of a LoRA token's row written, P planes
    to sum), its B stack (S, 1, N, R) and each token's slot (-1 = base). The projection's output is the
    base product only; whoever reads it adds ``B[slot] s`` first (``add_to``)."""

    buf: torch.Tensor
    lora_b: torch.Tensor
    token_slots: torch.Tensor
    # 0: buf's R columns are the token's own slot's; R: buf (P, 1, T, S * R) holds every slot's shrink (the
    # GEMM's shrink columns, ``decode_linear(shrink_into=...)``; a plane per piece of A), the token's at columns
    # [slot * R, slot * R + R)
    slot_cols: int = 0

    def add_to(self, y: torch.Tensor) -> torch.Tensor:
        """y + the delta, rounded once to y's dtype (a new tensor): what a reader without the fused kernel
        does (the torch path, ``row_delta``'s numbers in torch's order of the sum over r)."""
        s = self.buf.sum(0)[0]  # (T, R) fp32, the planes summed in order (or (T, S * R): every slot's)
        slots = self.token_slots.long()
        if self.slot_cols:
            R = self.lora_b.shape[3]
            cols = slots.clamp(min=0)[:, None] * self.slot_cols + torch.arange(R, device=s.device)
            s = torch.gather(s, 1, cols)
        return (y.float() + _delta_of_slots(s, self.lora_b, slots, y.dtype)).to(y.dtype)


class PendingQKVDelta(NamedTuple):
    """qkv_proj's LoRA delta left to the attention's rotary + KV-cache launch (``rotary_kv_cache(delta=...)``,
    ``row_delta``): x's shrink as the input norm computed it (buf (P, 3, T, R) fp32: q's, k's and v's
    slices, every column of a LoRA token's row written, P planes to sum), the three B stacks (S, 1, N_i, R) and
    each token's slot (-1 = base). The projection's output is the base product only; that launch adds
    ``B_i[slot] s_i`` to each slice's columns, or, where it does not run, the model does (``add_to``)."""

    buf: torch.Tensor
    lora_b: tuple[torch.Tensor, ...]
    token_slots: torch.Tensor

    def add_to(self, y: torch.Tensor) -> torch.Tensor:
        """y (T, N_q + N_k + N_v) + the delta, rounded once to y's dtype (a new tensor): the torch path's numbers."""
        slots = self.token_slots.long()
        # each slice's shrink (T, R), its planes summed in order, times its own B
        deltas = [_delta_of_slots(self.buf[:, i].sum(0), b, slots, y.dtype) for i, b in enumerate(self.lora_b)]
        return (y.float() + torch.cat(deltas, dim=1)).to(y.dtype)


class PunicaWrapper:
    def __init__(self, max_loras: int, device: torch.device):
        self.max_loras = max_loras
        self.device = device
        self.ops = torch_ops  # the reference, also used for what the kernels do not cover (embeddings)
        self.kernels = _select_backend(device)  # chosen once, by device type
        self.backend = "triton" if self.kernels is not None else "torch"
        # whether the kernel paths that fuse the LoRA with the GEMM (linear_with_lora, norm_shrink and the
        # deferred deltas) can run at all: asked before a layer checks its slots' extras
        self.fuses_linear = self.kernels is not None

    @staticmethod
    def mapping() -> LoRAMapping | None:
        return current_lora_mapping()

    def add_shrink(self, buf: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, ranks: list[int]) -> None:
        self.ops.lora_shrink(x, lora_a, self.mapping().token_segments, ranks, buf)

    def add_expand(
        self, y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, ranks: list[int], offset: int,
        act_dtype: torch.dtype,
    ) -> None:
        """y += buf @ B^T per token's slot; ``act_dtype``: the layer's input dtype (x of the shrink), which
        with B's picks the products' dtype (``precision.compute_dtype``)."""
        self.ops.lora_expand(y, buf, lora_b, self.mapping().token_segments, ranks, offset, act_dtype=act_dtype)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        ranks: list[int],
        segments: list | None = None,
    ) -> None:
        """y (T, sum(output_slices)) fp32 += per-slice B_i(A_i x) for each token's slot."""
        mapping = self.mapping()
        if self.kernels is not None and segments is None:
            self.kernels.add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, ranks, mapping.token_meta)
            return
        segs = mapping.token_segments if segments is None else segments
        offset = 0
        for a, b, n in zip(lora_a_stacked, lora_b_stacked, output_slices):
            buf = torch.zeros(x.shape[0], a.shape[2], dtype=torch.float32, device=x.device)  # (T, R)
            self.ops.lora_shrink(x, a, segs, ranks, buf)
            self.ops.lora_expand(y, buf, b, segs, ranks, offset, act_dtype=x.dtype)
            offset += n

    def apply_lora_linear(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        ranks: list[int],
    ) -> torch.Tensor:
        """out + the per-token LoRA delta, accumulated in fp32 and rounded once to out's dtype.

        The kernels add into ``out`` in place (fp32 add, one rounding per element: the same numbers
        as the reference's ``(out.float() + delta).to(out.dtype)``, without two extra passes).
        """
        if self.kernels is not None:
            self.kernels.add_lora_linear(
                out, x, lora_a_stacked, lora_b_stacked, ranks, self.mapping().token_meta
            )
            return out
        acc = out.float()
        self.add_lora_linear(acc, x, lora_a_stacked, lora_b_stacked, output_slices, ranks)
        return acc.to(out.dtype)

    def linear_with_lora(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        ranks: list[int],
        then_silu_and_mul: bool = False,
        shrunk: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The base GEMM and the LoRA delta in one go where a kernel does both (the GPU at decode sizes);
        None elsewhere: then the caller runs ``F.linear`` and ``apply_lora_linear``. ``then_silu_and_mul``
        (gate/up): silu(gate) * up of it, where a kernel path does that faster; None elsewhere.
        ``shrunk``: x's shrink, already computed (``norm_shrink``), instead of a shrink launch."""
        if not self.fuses_linear:
            return None
        mapping = self.mapping()
        return self.kernels.linear_with_lora(
            x, weight, bias, lora_a_stacked, lora_b_stacked, ranks, mapping.token_meta, mapping.token_slots,
            then_silu_and_mul, shrunk,
        )

    def norm_shrink(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        ranks: list[int],
        weight: torch.Tensor,
        delta: PendingDelta | None = None,
        in_k: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """RMSNorm of x (after the residual add) and the shrink of its output, in one launch, where the
        layer's ``linear_with_lora`` (GEMM ``weight``) would take that shrink: (out, residual', shrunk);
        else None (``TritonLoRAOps.norm_shrink``). ``delta``: x's pending delta, added to x first. ``in_k``:
        shrunk is the output with the shrink as more columns (``delta_in_k``), out their first K."""
        if not self.fuses_linear:
            return None
        mapping = self.mapping()
        return self.kernels.norm_shrink(
            x, residual, norm_weight, eps, lora_a_stacked, lora_b_stacked, ranks, weight, mapping.token_meta,
            mapping.token_slots, delta=delta, in_k=in_k,
        )

    def linear_deferring_delta(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        ranks: list[int],
        shrunk: torch.Tensor | None = None,
        gemm_shrink_rows: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, PendingDelta] | None:
        """(x W^T + b, the LoRA delta left to the output's reader) where a kernel path does that
        (``TritonLoRAOps.linear_deferring_delta``: a one-slice product at decode sizes); else None.
        ``gemm_shrink_rows``: the layer's method of that name."""
        if not self.fuses_linear:
            return None
        mapping = self.mapping()
        return self.kernels.linear_deferring_delta(
            x, weight, bias, lora_a_stacked, lora_b_stacked, ranks, mapping.token_meta, mapping.token_slots, shrunk,
            gemm_shrink_rows,
        )  # fmt: skip

    def qkv_deferring_delta(
        self, x, weight, bias, lora_a_stacked, lora_b_stacked, ranks, shrunk
    ) -> tuple[torch.Tensor, PendingQKVDelta] | None:
        """(x W^T + b, qkv's LoRA delta left to the attention's rotary launch) where a kernel path does that
        (``TritonLoRAOps.qkv_deferring_delta``: decode sizes, x's shrink computed by the norm that wrote x); else None.
        The arguments are ``linear_with_lora``'s; ``shrunk`` (T, 3 slices, R) from the input norm, or None."""
        if not self.fuses_linear:
            return None
        mapping = self.mapping()
        return self.kernels.qkv_deferring_delta(
            x, weight, bias, lora_a_stacked, lora_b_stacked, ranks, mapping.token_meta, mapping.token_slots, shrunk
        )

    def add_lora_embedding(
        self, y: torch.Tensor, ids: torch.Tensor, emb_a: torch.Tensor, lora_b: torch.Tensor, ranks: list[int]
    ) -> None:
        mapping = self.mapping()
        if self.kernels is not None:
            self.kernels.add_lora_embedding(
                y, ids, emb_a, lora_b, ranks, mapping.token_slots, mapping.token_meta
            )
            return
        self.ops.lora_embedding(y, ids, emb_a, lora_b, mapping.token_segments, ranks)

    def add_lora_logits(
        self, y: torch.Tensor, h: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: list[int]
    ) -> None:
        """y (R, V) fp32 += B(A h) for each logits row's slot."""
        mapping = self.mapping()
        if self.kernels is not None:
            self.kernels.add_lora_linear(y, h, (lora_a,), (lora_b,), ranks, mapping.logit_meta)
            return
        self.add_lora_linear(y, h, (lora_a,), (lora_b,), (lora_b.shape[2],), ranks, mapping.logit_segments)
