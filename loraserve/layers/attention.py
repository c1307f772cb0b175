"""Paged attention behind one interface.

The KV cache of a layer is two tensors (num_slots, num_kv_heads, head_dim), slot = block * block_size
+ offset, bound by the model runner (``bind_kv_cache``). The torch reference path gathers each
sequence's slots and runs SDPA with a causal (optionally sliding-window) mask. On CUDA the Triton
kernel (``triton_attention.py``: one launch per layer for the whole varlen batch, through block
tables) runs behind the same ``Attention.forward``, chosen once when the cache is bound.

Both paths read, per sequence, only its own slots below its context length: no other sequence's KV
and no freed block's stale KV reaches its rows, whatever they hold (NaN included, which a mask alone
would let through).

Attention also owns the step before the kernel: rotary on q and k, then the cache write. Given the
layer's ``RotaryEmbedding``, ``forward`` rotates them itself, so that on the Triton path one launch
(``triton_elementwise.rotary_kv_cache``) rotates q and k and stores k and v into the cache, instead
of a rotary launch plus two index_put launches.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.forward_context import AttentionMetadata, get_forward_context
from loraserve.layers.triton_dispatch import elementwise_kernels

if TYPE_CHECKING:
    from loraserve.layers.rotary import RotaryEmbedding


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q (T, Hq, D) over the cache -> (T, Hq, D)."""
    if md.num_seqs > 1 and md.max_query_len == 1:
        return _batched_decode(q, k_cache, v_cache, md, scale, sliding_window)
    out = torch.empty_like(q)
    for i in range(md.num_seqs):
        s, n, L = md.query_starts[i], md.query_lens[i], md.context_lens[i]
        qs = q[s : s + n].transpose(0, 1)  # (Hq, n, D)
        slots = md.kv_slots[i]
        ks = k_cache[slots].transpose(0, 1)  # (Hk, L, D)
        vs = v_cache[slots].transpose(0, 1)
        q_pos = torch.arange(L - n, L, device=q.device)[:, None]
        k_pos = torch.arange(L, device=q.device)[None, :]
        mask = k_pos <= q_pos  # (n, L)
        if sliding_window is not None:
            mask &= q_pos - k_pos < sliding_window
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + n] = o.transpose(0, 1)
    return out


def _decode_gather(md: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Lmax) cache slots of every sequence and the (B, Lmax) valid mask; built once per forward and
    shared by all layers. Row i holds sequence i's slots, padded past its context with its own last slot.

    NOTE: padding by construction reads only the sequence's own slot of its own query token, a key its
    row attends to anyway, so a padding entry adds no value the row does not already depend on. The
    mask alone cannot keep out another sequence's slot (the old slot 0, or a freed block's stale KV):
    a NaN there survives it (NaN + -inf is NaN, weight 0 * NaN is NaN)."""
    cached = md.gpu_cache.get("decode_gather")
    if cached is None:
        lmax = max(md.context_lens)
        ctx = torch.tensor(md.context_lens, device=device)
        first = torch.cumsum(ctx, 0) - ctx  # (B,) where each sequence's slots start in the flat list
        pos = torch.minimum(torch.arange(lmax, device=device)[None, :], ctx[:, None] - 1)  # (B, Lmax)
        slots = torch.cat(md.kv_slots)[first[:, None] + pos]
        valid = torch.arange(lmax, device=device)[None, :] < ctx[:, None]
        cached = md.gpu_cache["decode_gather"] = (slots, valid)
    return cached


def _batched_decode(q, k_cache, v_cache, md: AttentionMetadata, scale: float, sliding_window: int | None):
    """One query token per sequence: one SDPA over the padded batch instead of one per sequence."""
    slots, valid = _decode_gather(md, q.device)
    mask = valid
    if sliding_window is not None:  # the query sits at position context_len - 1
        k_pos = torch.arange(slots.shape[1], device=q.device)[None, :]
        q_pos = torch.tensor(md.context_lens, device=q.device)[:, None] - 1
        mask = mask & (q_pos - k_pos < sliding_window)
    ks = k_cache[slots].permute(0, 2, 1, 3)  # (B, Hk, L, D)
    vs = v_cache[slots].permute(0, 2, 1, 3)
    qs = q[torch.tensor(md.query_starts, device=q.device)][:, :, None, :]  # (B, Hq, 1, D)
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    out = torch.empty_like(q)
    out[torch.tensor(md.query_starts, device=q.device)] = o[:, :, 0, :]
    return out


def _select_kernel(device: torch.device):
    """The Triton kernel on CUDA when Triton is installed (imported lazily), else None: the torch reference."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from loraserve.layers.triton_attention import paged_attention

        return paged_attention
    return None


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._kernel = None

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self._kernel = _select_kernel(k_cache.device)  # chosen once, by the cache's device type

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | None = None,
        rotary_emb: RotaryEmbedding | None = None,
        qkv_delta=None,
    ) -> torch.Tensor:
        """q (T, Hq*D), k/v (T, Hk*D) (or (T, H, D) views, head_dim contiguous) -> (T, Hq*D).

        Writes k and v into the cache at the forward's ``slot_mapping``, then attends over the cache.
        With ``rotary_emb`` and ``positions`` (T,), q and k arrive unrotated and are rotated here
        first (the cache holds rotated k and plain v); without them they are taken as rotated already.
        The result is the same either way; with the Triton kernel bound, the rotation and the cache
        write are one launch.

        ``qkv_delta``: the LoRA delta the qkv projection left to this launch (a ``punica.PendingQKVDelta``;
        ``takes_qkv_delta`` says where): the rotary launch adds it to q, k and v first.
        """
        md = get_forward_context().attn
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        assert self.k_cache is not None, (
            "KV cache not bound; the model runner binds it before the first forward"
        )
        assert (positions is None) == (rotary_emb is None), "pass positions and rotary_emb together"
        assert qkv_delta is None or self.takes_qkv_delta(rotary_emb), (
            "a qkv delta where the rotary launch is not run"
        )
        if self.takes_qkv_delta(rotary_emb):
            cos, sin = rotary_emb.cos_sin(positions, q.dtype)  # (T, rotary_dim) each, shared per forward
            q = elementwise_kernels().rotary_kv_cache(
                q, k, v, cos, sin, self.k_cache, self.v_cache, md.slot_mapping, delta=qkv_delta
            )  # (T, Hq, D)
        else:
            if rotary_emb is not None:
                q, k = rotary_emb(positions, q, k)
            self.k_cache[md.slot_mapping] = k.to(self.k_cache.dtype)
            self.v_cache[md.slot_mapping] = v.to(self.v_cache.dtype)
        if self._kernel is None:
            o = reference_paged_attention(q, self.k_cache, self.v_cache, md, self.scale, self.sliding_window)
            return o.reshape(T, self.num_heads * self.head_dim)
        o = self._kernel(q, self.k_cache, self.v_cache, md, self.scale, self.sliding_window)
        return o.reshape(T, self.num_heads * self.head_dim)

    def takes_qkv_delta(self, rotary_emb: RotaryEmbedding | None) -> bool:
        """Whether ``forward`` rotates and writes the cache in one launch (the Triton kernels, with rotary), which
        adds a qkv delta too: else the caller adds it to qkv itself (``PendingQKVDelta.add_to``)."""
        return rotary_emb is not None and self._kernel is not None
