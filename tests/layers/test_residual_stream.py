"""The decoder's residual stream (``layer(positions, h, residual) -> (h, residual)``, the adds done by
``RMSNorm(x, residual)``) is a restructure only: on the torch path it gives the same bits as the plain
``h = h + attn(norm(h)); h = h + mlp(norm(h))`` formulation, in bf16 (where a different order of
rounding would show) and fp32.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from loraserve.engine.model_runner import attention_layers
from loraserve.forward_context import AttentionMetadata, forward_context
from loraserve.layers.norm import RMSNorm, rms_norm_torch
from loraserve.models.loader import init_dummy_weights
from loraserve.models.registry import get_model_class


def plain_forward(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The formulation before the residual stream: every add explicit, each norm on the sum."""
    m = model.model
    h = m.embed_tokens(ids)
    for layer in m.layers:
        h = h + layer.self_attn(pos, layer.input_layernorm(h))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_residual_stream_is_bit_identical_to_plain_adds(dtype, arch):
    cfg_cls = transformers.LlamaConfig if arch == "LlamaForCausalLM" else transformers.Qwen3Config
    cfg = cfg_cls(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, architectures=[arch])  # fmt: skip
    model = get_model_class(cfg)(cfg)
    init_dummy_weights(model, seed=3, std=0.2)
    model.to(dtype)
    for attn in attention_layers(model):
        k = torch.zeros(16, attn.num_kv_heads, attn.head_dim, dtype=dtype)
        attn.bind_kv_cache(k, torch.zeros_like(k))
    T = 9
    ids, pos = torch.randint(0, 128, (T,), generator=torch.Generator().manual_seed(4)), torch.arange(T)
    md = AttentionMetadata(slot_mapping=pos, query_starts=[0], query_lens=[T], context_lens=[T], kv_slots=[pos])
    with torch.inference_mode(), forward_context(attn=md):
        got = model(ids, pos)
        want = plain_forward(model, ids, pos)
    assert got.dtype == dtype and torch.equal(got, want)


def test_rms_norm_with_residual_returns_the_sum_and_its_norm():
    norm = RMSNorm(32, 1e-5)
    norm.weight.data.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    x, r = (torch.randn(4, 32, generator=g) * 3).bfloat16(), (torch.randn(4, 32, generator=g) * 3).bfloat16()
    out, res = norm(x, r)
    assert torch.equal(res, x + r) and torch.equal(out, rms_norm_torch(x + r, norm.weight, 1e-5))
    assert torch.equal(norm(x), rms_norm_torch(x, norm.weight, 1e-5))  # no residual: a plain norm


class _Feeds(torch.nn.Module):
    """A layer with the ``fuse_norm`` hook: returns ``result`` (None: declines) and records its calls."""

    def __init__(self, result):
        super().__init__()
        self.result, self.calls = result, []

    def fuse_norm(self, x, residual, weight, eps, delta=None):
        self.calls.append((x, residual, eps) if delta is None else (x, residual, eps, delta))
        return self.result


def test_a_norm_hands_itself_to_the_layer_it_feeds_only_on_the_triton_path(monkeypatch):
    import types

    import loraserve.layers.norm as norm_mod

    norm = RMSNorm(32, 1e-5)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    want_out, want_res = norm(x, r)
    taker = _Feeds(("fused", "pair"))
    assert torch.equal(norm(x, r, feeds=taker)[0], want_out) and not taker.calls, "CPU tensors: the norm runs here"
    monkeypatch.setattr(norm_mod, "on_triton", lambda t: True)
    # the Triton add + norm, stood in for by torch's (this test runs without triton)
    kernels = types.SimpleNamespace(fused_add_rms_norm=lambda x, r, w, eps, delta=None: (rms_norm_torch(x + r, w, eps), x + r))
    monkeypatch.setattr(norm_mod, "elementwise_kernels", lambda: kernels)
    assert norm(x, r, feeds=taker) == ("fused", "pair") and taker.calls == [(x, r, 1e-5)]
    decliner = _Feeds(None)
    out, res = norm(x, r, feeds=decliner)
    assert decliner.calls and torch.equal(out, want_out) and torch.equal(res, want_res)


class _Delta:
    """A stand-in for ``punica.PendingDelta``: ``add_to`` adds a constant (the torch path a reader falls back to)."""

    def add_to(self, y):
        return y + 0.5


def test_a_norm_takes_the_delta_left_to_it(monkeypatch):
    """An output whose projection deferred its LoRA delta (forward_context.defer_delta): the norm reading it takes
    the delta, in its kernel's launch where it can (the residual add on the Triton path: the delta handed to the
    kernel and to a fusing layer), else added in torch first; a norm of another tensor leaves it, and a delta
    nobody takes is an error when the forward ends."""
    import types

    import loraserve.layers.norm as norm_mod
    from loraserve.forward_context import defer_delta, forward_context

    norm = RMSNorm(32, 1e-5)
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    want_out, want_res = norm(x + 0.5, r)
    delta = _Delta()
    with forward_context():
        defer_delta(x, delta)
        out, res = norm(x, r)  # CPU tensors: torch's add_to, then the norm
    assert torch.equal(out, want_out) and torch.equal(res, want_res)
    with pytest.raises(RuntimeError, match="never taken"), forward_context():
        defer_delta(x, delta)
        norm(x.clone(), r)  # another tensor: not x's reader
    monkeypatch.setattr(norm_mod, "on_triton", lambda t: True)
    handed = []
    kernels = types.SimpleNamespace(
        fused_add_rms_norm=lambda x, r, w, eps, delta=None: handed.append(delta) or (rms_norm_torch(x + r, w, eps), x + r),
        rms_norm=rms_norm_torch,
    )
    monkeypatch.setattr(norm_mod, "elementwise_kernels", lambda: kernels)
    taker = _Feeds(("fused", "pair"))
    with forward_context():
        defer_delta(x, delta)
        assert norm(x, r, feeds=taker) == ("fused", "pair") and taker.calls == [(x, r, 1e-5, delta)]
    with forward_context():
        defer_delta(x, delta)
        norm(x, r, feeds=_Feeds(None))
    assert handed == [delta], "a declining layer: the add + norm kernel gets the delta"
    with forward_context():
        defer_delta(x, delta)
        out = norm(x)  # no residual: no kernel takes it, added in torch first
    assert torch.equal(out, rms_norm_torch(x + 0.5, norm.weight, 1e-5))
