"""Rotary position embedding (HF's rotate-half layout) with the rope types our configs use.

inv_freq follows transformers' ``modeling_rope_utils`` formulas for default, linear, llama3 and yarn;
yarn also scales cos/sin by its attention factor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraserve.forward_context import get_forward_context_or_none
from loraserve.layers.triton_dispatch import elementwise_kernels, on_triton


def rope_parameters(hf_config) -> dict:
    """The config's rope parameters as one dict (transformers v5 ``rope_parameters``, or v4 fields)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _yarn(params: dict, dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = params.get("original_max_position_embeddings") or max_pos
    factor = params.get("factor") or max_pos / orig

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(params: dict, rotary_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / params["factor"], 1.0
    if kind == "llama3":
        factor, low_ff, high_ff = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(params, rotary_dim, base, max_pos)
    raise NotImplementedError(
        f"rope_type {kind!r} is not supported; supported: default, linear, llama3, yarn"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, hf_config):
        super().__init__()
        params = rope_parameters(hf_config)
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq, self.attention_scaling = compute_inv_freq(
            params, self.rotary_dim, getattr(hf_config, "max_position_embeddings", 2048)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._key = (self.rotary_dim, float(self.attention_scaling), tuple(inv_freq.tolist()))  # same rope, same cos/sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, rotary_dim) in ``dtype``, rows cat(f, f) (HF's layout and roundings).

        Inside a forward they are computed once and shared by every layer with the same rope (the
        forward's ``AttentionMetadata.gpu_cache``): ~8 small kernels per step instead of per layer.
        """
        ctx = get_forward_context_or_none()
        cache = ctx.attn.gpu_cache if ctx is not None and ctx.attn is not None else None
        key = ("rope", self._key, dtype, positions.data_ptr(), positions.shape[0])
        if cache is not None and key in cache:
            return cache[key]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        out = ((emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype))
        if cache is not None:
            cache[key] = out
        return out

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, Hq, D), k (T, Hk, D), positions (T,) -> rotated q, k (same dtype)."""
        cos, sin = self.cos_sin(positions, q.dtype)
        if on_triton(q):
            return self._rotate_gpu(q, k, cos, sin)
        return rotate_torch(q, cos, sin), rotate_torch(k, cos, sin)

    @staticmethod
    def _rotate_gpu(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch; q and k as one (T, Hq + Hk, D) view when k's heads follow q's in memory
        (the qkv projection's output, split), else one launch each."""
        rotary = elementwise_kernels().rotary
        T, Hq, D = q.shape
        adjacent = (
            k.dtype == q.dtype and k.shape[0] == T and k.shape[2] == D and k.stride() == q.stride()
            and q.stride(1) == D and q.stride(2) == 1
            and k.data_ptr() == q.data_ptr() + Hq * D * q.element_size()
            # NOTE: one storage, not just neighbouring addresses: two separate allocations (q/k-norm
            # outputs at T == 1) can sit back to back, and as_strided past q's storage raises
            and k.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()
        )  # fmt: skip
        if not adjacent:
            return rotary(q, cos, sin), rotary(k, cos, sin)
        qk = q.as_strided((T, Hq + k.shape[1], D), q.stride())
        out = rotary(qk, cos, sin)
        return out[:, :Hq], out[:, Hq:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) rotated by cos/sin (T, rotary_dim): the reference (HF's apply_rotary_pos_emb); the
    Triton kernel is checked against it."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    rot = rot * cos + _rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.numel() else rot
