"""The GPU backend of ``PunicaWrapper``: the Triton shrink/expand kernels on ``SegmentMeta``.

Imported only when a PunicaWrapper is built on CUDA with Triton installed (CPU installs never
import triton). Per layer and op: one shrink launch and one expand launch for all 1-3 slices.

NOTE: a one-launch variant (shrink recomputed per output chunk, no partials) was measured on the
H200 and was 2.5-9x slower than shrink + expand at decode sizes (each program streamed all of K
alone); it was dropped.
"""

from __future__ import annotations

import torch

from loraserve.layers import triton_decode_linear as decode
from loraserve.lora.ops.triton import gated_lora, norm_shrink, row_delta
from loraserve.lora.ops.triton.lora_expand import lora_expand
from loraserve.lora.ops.triton.lora_shrink import lora_shrink
from loraserve.lora.ops.triton.utils import use_pdl
from loraserve.lora.punica import PendingDelta, PendingQKVDelta, SegmentMeta


class TritonLoRAOps:
    def __init__(self, device: torch.device):
        self.device = device
        # id(ranks list) -> (the list, its contents when copied, int32 device copy). Layers keep their
        # ``slot_ranks`` list for life, so the id is stable; holding the list keeps the id unique.
        self._ranks: dict[int, tuple[list[int], tuple[int, ...], torch.Tensor]] = {}

    def ranks_tensor(self, ranks: list[int]) -> torch.Tensor:
        """The device copy of a layer's per-slot ranks, refreshed in place when the list changed."""
        entry = self._ranks.get(id(ranks))
        now = tuple(ranks)
        if entry is None:
            dev = torch.tensor(now, dtype=torch.int32).to(self.device)
            self._ranks[id(ranks)] = (ranks, now, dev)
            return dev
        _, seen, dev = entry
        if seen != now:
            dev.copy_(torch.tensor(now, dtype=torch.int32), non_blocking=False)
            self._ranks[id(ranks)] = (ranks, now, dev)
        return dev

    def refresh_ranks(self) -> None:
        """Bring every device rank copy up to date (before replaying a CUDA graph, which runs no Python)."""
        for ranks, _, _ in list(self._ranks.values()):
            self.ranks_tensor(ranks)

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        ranks: list[int],
        meta: SegmentMeta,
    ) -> None:
        """y (T, sum N_i) += per-slice B_i(A_i x) per token's slot; y fp32 or the layer's dtype (rounded once).

        The shrink then the expand (PDL-chained).

        NOTE: one launch for both at prefill sizes (each program's shrink tile, then its share of the expand
        behind a grid-wide flag) was measured slower than these two launches and removed."""
        assert meta is not None, "the LoRA mapping has no SegmentMeta: build it with a CUDA device"
        rank_dev = self.ranks_tensor(ranks)
        max_rank = _max_rank(lora_a_stacked, ranks, meta)
        if max_rank == 0:
            return
        buf = lora_shrink(x, lora_a_stacked, meta, rank_dev, max_rank)
        lora_expand(y, buf, lora_b_stacked, meta, rank_dev, act_dtype=x.dtype)

    def linear_with_lora(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        ranks: list[int],
        meta: SegmentMeta,
        token_slots: torch.Tensor,
        then_silu_and_mul: bool = False,
        shrunk: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """x W^T + b + the per-token LoRA delta as two launches (shrink, then the GEMM with the expand
        in its epilogue, PDL-overlapped; the shrink launches while the kernel before it runs when that
        kernel is a link of the PDL chain, utils.pdl_chain), or None where ``decode_linear`` does not apply (too many
        tokens, fp32, slices that are not multiples of its column block): the caller then runs the
        GEMM and ``add_lora_linear``. Same numbers as that path (decode_linear.py's docstring).

        ``then_silu_and_mul`` (a gate/up projection, two equal slices): silu(gate) * up of that result, as
        three launches: the shrink, the plain GEMM (streaming W while the shrink runs), and SiLU-and-mul
        with the delta added first (``gated_lora``); or None where that is not the faster path
        (``gated_lora.prefer``) or does not apply: the caller then takes the path above and SiLU-and-mul.
        The same numbers as that path.

        ``shrunk``: x's shrink as ``lora_shrink(..., zero_fill=True)`` writes it, computed by the launch
        that wrote x (``norm_shrink``): no shrink launch, and the GEMM is an ordinary link of the PDL
        chain (it waits for that launch before reading x, so buf is complete too)."""
        tiles = self._decode_tiles(x, weight, lora_b_stacked, meta)
        if then_silu_and_mul:
            gate_up = len(lora_b_stacked) == 2 and lora_b_stacked[0].shape == lora_b_stacked[1].shape
            gate_up = gate_up and lora_b_stacked[0].shape[2] % gated_lora.BLOCK_N == 0
            if tiles is None or not gate_up or not gated_lora.prefer(weight.shape[0], weight.shape[1]):
                return None
        if tiles is None:
            return None
        shrink = self._shrink_for(x, lora_a_stacked, ranks, meta, shrunk)
        if shrink is None:
            return None if then_silu_and_mul else decode.decode_linear(x, weight, bias, tiles=tiles)
        buf, pdl = shrink
        if then_silu_and_mul:
            y = decode.decode_linear(x, weight, bias, tiles=tiles, after_shrink=pdl)
            return gated_lora.silu_and_mul_lora(y, buf, lora_b_stacked, token_slots)
        epilogue = decode.ExpandEpilogue(buf, lora_b_stacked, token_slots, pdl=pdl)
        return decode.decode_linear(x, weight, bias, lora=epilogue, tiles=tiles)

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
        meta: SegmentMeta,
        token_slots: torch.Tensor,
        delta: PendingDelta | None = None,
        in_k: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """(RMSNorm(x + residual), x + residual, the output's shrink) in one launch (``norm_shrink``), where
        the kernel supports the shapes, some slot has a rank, and ``linear_with_lora`` of the output with this GEMM ``weight`` takes the decode path; else None.
        ``delta``: x's pending delta (``row_delta``), added to x first in the same launch. ``in_k``: the shrink
        as x's extra columns (``delta_in_k``; the third result is that wider x)."""
        if x.dim() != 2 or not norm_shrink.supports(x, lora_a_stacked):
            return None
        if torch.promote_types(norm_weight.dtype, x.dtype) != x.dtype:
            return None  # the norm's output (weight * x's dtype) would not be what decode_linear takes
        if self._decode_tiles(x, weight, lora_b_stacked, meta) is None:
            return None
        if _max_rank(lora_a_stacked, ranks, meta) == 0:
            return None  # nothing to add: linear_with_lora runs the plain GEMM
        return norm_shrink.norm_shrink(
            x, residual, norm_weight, eps, lora_a_stacked, token_slots, self.ranks_tensor(ranks), delta=delta, in_k=in_k
        )

    def linear_deferring_delta(
        self, x, weight, bias, lora_a_stacked, lora_b_stacked, ranks, meta, token_slots, shrunk=None, gemm_shrink_rows=None
    ) -> tuple[torch.Tensor, PendingDelta] | None:
        """(x W^T + b, the delta left to its reader): the shrink (or ``shrunk``, x's shrink computed by the
        launch that wrote x), then the plain decode GEMM as the shrink's PDL dependent (``after_shrink``: it
        streams W while the shrink runs; its completion implies the shrink's, so its reader, a link of the PDL
        chain, finds buf written). With ``gemm_shrink_rows`` (the layer's method: A's pieces in W's dtype, built
        on first call, so only where this path gets that far) where ``row_delta.shrink_in_gemm`` takes them, no
        shrink launch: the GEMM's extra column blocks compute every slot's shrink, a plane per piece
        (``decode_linear(shrink_into=...)``), and the reader sums the planes of its token's slot's columns.
        Where there is one slice, ``row_delta.supports`` B, some slot has a rank and the decode GEMM applies;
        else None."""
        if len(lora_b_stacked) != 1 or not row_delta.supports(x.dtype, lora_b_stacked[0]):
            return None
        tiles = self._decode_tiles(x, weight, lora_b_stacked, meta)
        if tiles is None:
            return None
        gemm_rows = gemm_shrink_rows() if shrunk is None and gemm_shrink_rows is not None else None
        if gemm_rows is not None and row_delta.shrink_in_gemm(gemm_rows, weight, tiles.block_n):
            if _max_rank(lora_a_stacked, ranks, meta) == 0:
                return None
            P, S, R, K = gemm_rows.shape
            T = x.shape[0]
            s = torch.empty(T, P * S * R, dtype=torch.float32, device=x.device)
            y = decode.decode_linear(x, weight, bias, tiles=tiles, shrink_into=(gemm_rows.view(P * S * R, K), s))
            planes = s.view(T, P, S * R).permute(1, 0, 2).unsqueeze(1)  # (P, 1, T, S * R): a plane per piece
            return y, PendingDelta(planes, lora_b_stacked[0], token_slots, slot_cols=R)
        shrink = self._shrink_for(x, lora_a_stacked, ranks, meta, shrunk)
        if shrink is None:
            return None
        buf, pdl = shrink
        y = decode.decode_linear(x, weight, bias, tiles=tiles, after_shrink=pdl)
        return y, PendingDelta(buf, lora_b_stacked[0], token_slots)

    def qkv_deferring_delta(
        self, x, weight, bias, lora_a_stacked, lora_b_stacked, ranks, meta, token_slots, shrunk
    ) -> tuple[torch.Tensor, PendingQKVDelta] | None:
        """(x W^T + b, qkv's delta left to the attention's rotary + KV-cache launch): the plain decode GEMM, which
        lets that launch start only after its own wait for the input norm (``trigger_after_wait``), so that
        the launch reads the norm's shrink (``shrunk``) and computes the delta before its wait, while the GEMM
        still runs. Where K is at most ``row_delta.QKV_MAX_HIDDEN``, the norm computed x's shrink, three slices
        (q, k, v) whose B ``row_delta.supports`` (any width), some slot has a rank and the decode GEMM applies;
        else None."""
        if shrunk is None or len(lora_b_stacked) != 3:
            return None
        if x.shape[-1] > row_delta.QKV_MAX_HIDDEN:
            return None  # a large model's qkv keeps its epilogue (QKV_MAX_HIDDEN)
        if not all(row_delta.supports(x.dtype, b, None) for b in lora_b_stacked):
            return None
        tiles = self._decode_tiles(x, weight, lora_b_stacked, meta)
        if tiles is None or _max_rank(lora_a_stacked, ranks, meta) == 0:
            return None
        y = decode.decode_linear(x, weight, bias, tiles=tiles, trigger_after_wait=True)
        return y, PendingQKVDelta(shrunk, tuple(lora_b_stacked), token_slots)

    def _decode_tiles(self, x, weight, lora_b_stacked, meta) -> decode.DecodeTiles | None:
        """The decode GEMM's tiles for this LoRA'd product, or None where ``decode_linear`` does not apply
        (no device mapping, too many tokens, fp32, slices that are not multiples of its column block)."""
        if meta is None:
            return None
        slices = tuple(b.shape[2] for b in lora_b_stacked)
        tiles = decode.default_tiles(x.shape[0], weight.shape[0], weight.shape[1], x.dtype, slices)
        return tiles if decode.supports(x, weight, slices, tiles) else None

    def _shrink_for(self, x, lora_a_stacked, ranks, meta, shrunk) -> tuple[torch.Tensor, bool] | None:
        """(buf, whether the GEMM is its PDL dependent) of a fused decode path: ``shrunk`` (x's shrink, computed by
        the launch that wrote x: the GEMM is an ordinary link after it), else a shrink launch of its own
        (``_decode_shrink``); None when no slot has a rank."""
        if shrunk is not None:
            return shrunk, False
        return self._decode_shrink(x, lora_a_stacked, ranks, meta)

    def _decode_shrink(self, x, lora_a_stacked, ranks, meta) -> tuple[torch.Tensor, bool] | None:
        """The shrink of a decode-size fused path: (buf, whether the next launch is its PDL dependent), or
        None when no slot has a rank (nothing to add).

        zero_fill: the readers (the GEMM's epilogue, ``gated_lora``) load no rank, so every column of a
        LoRA token's row is written. NOTE: a PDL dependent may read x before its wait only because the
        shrink waited first; with no segment the shrink launches nothing and the next kernel is a plain
        link of the PDL chain, which waits first."""
        rank_dev = self.ranks_tensor(ranks)
        max_rank = _max_rank(lora_a_stacked, ranks, meta)
        if max_rank == 0:
            return None
        buf = lora_shrink(x, lora_a_stacked, meta, rank_dev, max_rank, zero_fill=True)
        return buf, use_pdl(x.device) and meta.num_segs > 0

    def add_lora_embedding(
        self,
        y: torch.Tensor,
        ids: torch.Tensor,
        emb_a: torch.Tensor,
        lora_b: torch.Tensor,
        ranks: list[int],
        token_slots: torch.Tensor,
        meta: SegmentMeta,
    ) -> None:
        """y (T, H) fp32 += A^T[slot(t), ids[t]] @ B[slot(t)]^T: a row gather, then the expand kernel."""
        assert meta is not None, "the LoRA mapping has no SegmentMeta: build it with a CUDA device"
        rank_dev = self.ranks_tensor(ranks)
        if not meta.static and max(ranks) == 0:
            return
        rows = emb_a[token_slots.clamp(min=0), ids].float()  # (T, R); rows of base tokens are never read
        # the "activations" are A's rows in its storage dtype: B's products are exact in it (fp32 for fp32)
        lora_expand(y, rows.view(1, 1, *rows.shape), (lora_b,), meta, rank_dev, act_dtype=emb_a.dtype)


def _max_rank(lora_a_stacked: tuple[torch.Tensor, ...], ranks: list[int], meta: SegmentMeta) -> int:
    """The shrink's rank columns: every slot's (R) under a CUDA graph's static mapping, whose slots change
    between replays; else the largest rank in use (0: nothing to add)."""
    return lora_a_stacked[0].shape[2] if meta.static else max(ranks)
