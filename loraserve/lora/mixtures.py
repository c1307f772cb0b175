"""Per-request adapter mixtures: several adapters combined into one LoRA, as PEFT's add_weighted_adapter.

- linear: A = [A_1; ...; A_n], B = [w_1 s_1 B_1, ..., w_n s_n B_n], so B A x = sum_i w_i s_i B_i A_i x
  exactly (PEFT calls this "cat"); the rank is the sum of the ranks.
- ties / dare_linear / dare_ties: PEFT's non-SVD rules, on A and B separately with weights
  sign(w s) sqrt(|w s|) for A and sqrt(|w s|) for B: TIES trims each task to its top ``density``
  magnitudes, elects a per-entry sign by the summed (unweighted) values and averages the agreeing
  weighted ones;
  DARE drops entries at random with keep probability ``density`` and rescales by 1/density.
"""

from __future__ import annotations

import math

import torch

from loraserve.lora.errors import LoRARankError, LoRAUnsupportedFeatureError
from loraserve.lora.peft import LoRAAdapter, LoRAModuleWeights


def _trim(t: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return t
    k = int(density * t.numel())
    keep = torch.zeros(t.numel(), dtype=t.dtype)
    keep[t.abs().reshape(-1).topk(k).indices] = 1
    return t * keep.reshape(t.shape)


def _drop(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    if density >= 1:
        return t
    mask = torch.bernoulli(torch.full_like(t, density), generator=gen)
    return t * mask / density


def _sign_merge(tasks: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """tasks (n, ...): the sign is elected on the unweighted sum; agreeing weighted entries are averaged."""
    majority = torch.where(tasks.sum(dim=0) >= 0, 1.0, -1.0)
    agree = tasks.sign() == majority  # pruned zeros never agree
    return (tasks * w * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


def _merge(tensors: list[torch.Tensor], weights: list[float], how: str, density: float, gen) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32).view(-1, *([1] * tensors[0].dim()))
    if how == "ties":
        return _sign_merge(torch.stack([_trim(t, density) for t in tensors]), w)
    if how == "dare_linear":
        return (torch.stack([_drop(t, density, gen) for t in tensors]) * w).sum(dim=0)
    if how == "dare_ties":
        return _sign_merge(torch.stack([_drop(t, density, gen) for t in tensors]), w)
    raise ValueError(how)


def combine_adapters(
    name: str,
    adapters: list[LoRAAdapter],
    weights: list[float],
    combination: str,
    max_rank: int,
    density: float = 1.0,
    seed: int = 0,
) -> LoRAAdapter:
    for a in adapters:
        if a.bias_replacements or a.weight_replacements or a.trainable_tokens or any(
            m.magnitude is not None or m.lora_bias is not None or m.num_experts for m in a.modules.values()
        ):
            raise LoRAUnsupportedFeatureError(
                f"adapter {a.name!r} ({a.path}) carries DoRA, biases, modules_to_save, trainable tokens or "
                f"target_parameters (MoE expert) LoRA; "
                f"mixtures of such adapters are not supported yet"
            )
    gen = torch.Generator().manual_seed(seed)
    modules: dict[str, LoRAModuleWeights] = {}
    for mod in sorted(set().union(*(a.modules for a in adapters))):
        parts = [(a.modules[mod], w) for a, w in zip(adapters, weights) if mod in a.modules]
        emb = parts[0][0].is_embedding
        # embedding A is (r, V), B is (H, r): rank sits on the same axes as for linear layers
        if combination == "linear":
            a = torch.cat([m.lora_a for m, _ in parts], dim=0)
            b = torch.cat([m.lora_b * w for m, w in parts], dim=1)  # B is already s_i * B_i
        else:
            ranks = {m.rank for m, _ in parts}
            if len(ranks) != 1:
                raise LoRARankError(f"mixture {name!r}: {combination} needs equal ranks at {mod!r}, got {sorted(ranks)}")
            ws = [w * m.scaling for m, w in parts]
            wa = [math.copysign(math.sqrt(abs(x)), x) for x in ws]
            wb = [math.sqrt(abs(x)) for x in ws]
            a = _merge([m.lora_a for m, _ in parts], wa, combination, density, gen)
            b = _merge([m.lora_b / m.scaling for m, _ in parts], wb, combination, density, gen)
        r = a.shape[0]
        if r > max_rank:
            raise LoRARankError(f"mixture {name!r} has rank {r} at {mod!r} > max_lora_rank {max_rank}; restart with --max-lora-rank {r}")
        modules[mod] = LoRAModuleWeights(mod, a.contiguous(), b.contiguous(), r, 1.0, emb)
    copies = {}
    for a in adapters:
        copies.update(a.base_weight_copies)
    return LoRAAdapter(name=name, path="+".join(a.path for a in adapters), config={"mixture": combination},
                       modules=modules, base_weight_copies=copies)
