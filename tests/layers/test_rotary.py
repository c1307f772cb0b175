"""RotaryEmbedding's per-forward cos/sin: computed once and shared by every layer with the same rope.

The cache lives in the forward's AttentionMetadata (``gpu_cache``), so it can never outlive a step:
a new forward (new positions, or the same tensor refilled, as CUDA graphs do) computes afresh.
"""

from __future__ import annotations

import torch

from loraserve.forward_context import AttentionMetadata, forward_context
from loraserve.layers.rotary import RotaryEmbedding, rotate_torch


class _Cfg:  # the fields RotaryEmbedding reads
    rope_parameters = None
    rope_scaling = None
    max_position_embeddings = 4096

    def __init__(self, theta: float):
        self.rope_theta = theta


def _md(pos: torch.Tensor) -> AttentionMetadata:
    n = pos.shape[0]
    return AttentionMetadata(slot_mapping=pos, query_starts=[0], query_lens=[n], context_lens=[n], kv_slots=[])


def test_layers_with_the_same_rope_share_cos_sin_within_a_forward():
    a, b, other = RotaryEmbedding(64, _Cfg(1e4)), RotaryEmbedding(64, _Cfg(1e4)), RotaryEmbedding(64, _Cfg(5e5))
    pos = torch.arange(7)
    md = _md(pos)
    with forward_context(attn=md):
        ca, cb, co = a.cos_sin(pos, torch.float32), b.cos_sin(pos, torch.float32), other.cos_sin(pos, torch.float32)
    assert ca[0] is cb[0] and ca[1] is cb[1]  # one computation for both layers
    assert co[0] is not ca[0] and not torch.equal(co[0], ca[0])  # another theta, its own entry
    assert len(md.gpu_cache) == 2


def test_cached_rotation_equals_uncached_and_a_new_forward_recomputes():
    rope = RotaryEmbedding(32, _Cfg(1e4))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    pos = torch.tensor([0, 3, 9, 100, 4000])
    want = rope(pos, q, k)  # no forward context: no cache
    with forward_context(attn=_md(pos)):
        got = rope(pos, q, k)
        again = rope(pos, q, k)
    for w, x, y in zip(want, got, again):
        torch.testing.assert_close(x, w, rtol=0, atol=0)
        torch.testing.assert_close(y, w, rtol=0, atol=0)
    pos.copy_(torch.tensor([1, 2, 3, 4, 5]))  # the same tensor refilled for the next step (CUDA graphs)
    with forward_context(attn=_md(pos)):
        cos, sin = rope.cos_sin(pos, torch.float32)
        torch.testing.assert_close(rope(pos, q, k)[0], rotate_torch(q, cos, sin), rtol=0, atol=0)
    fresh = rope.cos_sin(pos, torch.float32)
    torch.testing.assert_close(cos, fresh[0], rtol=0, atol=0)
