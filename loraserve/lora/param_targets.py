"""Which expert parameter a ``target_parameters`` LoRA key adapts (PEFT's ParamWrapper on MoE experts).

The key does not name the parameter (``<m>.base_layer.lora_A`` / ``<m>.lora_A``); the config's
``target_parameters``, the nesting depth and the shapes decide (``resolve_param_targets``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.lora.errors import LoRAFormatError, LoRAUnsupportedFeatureError

# 3-D expert parameters a target_parameters LoRA may adapt, in HF's registration order (input projection first)
EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")
_BASE_LAYER = ".base_layer"


def _fits_gated(a_in, b_in, a_down, b_down) -> bool:
    """Do these factors fit gate_up_proj (A (., H), B (2I, .)) and down_proj (A (., I), B (H, .))?"""
    return a_in.shape[1] == b_down.shape[0] and b_in.shape[0] == 2 * a_down.shape[1]


def resolve_param_targets(cfg: dict, parts: dict[str, dict[str, torch.Tensor]], f: Path) -> dict[str, str]:
    """target_parameters LoRA keys -> the parameter path they adapt ('...experts.base_layer' -> '...experts.gate_up_proj').

    PEFT wraps each targeted parameter of a module in its own ParamWrapper, nesting them in registration order
    (first registered innermost): with gate_up_proj and down_proj both targeted, ``<m>.base_layer.lora_*`` is
    gate_up_proj and ``<m>.lora_*`` is down_proj. The key does not name the parameter, so: a module with one
    candidate in target_parameters takes it; with two, shapes decide (gate_up: A (., H), B (2I, .); down:
    A (., I), B (H, .)), registration order only when shapes cannot (non-gated experts).
    """
    targets = cfg.get("target_parameters") or []
    if not targets:
        return {}
    groups: dict[str, dict[int, str]] = {}
    for key in parts:
        base, depth = key, 0
        while base.endswith(_BASE_LAYER):
            base, depth = base[: -len(_BASE_LAYER)], depth + 1
        groups.setdefault(base, {})[depth] = key
    out: dict[str, str] = {}
    for base, by_depth in groups.items():
        cands = []
        for t in targets:
            param = t.rpartition(".")[2]
            full = f"{base}.{param}"
            if (full == t or full.endswith("." + t)) and param not in cands:
                cands.append(param)
        if not cands:
            if len(by_depth) > 1 or 0 not in by_depth:
                raise LoRAFormatError(
                    f"adapter {f}: nested LoRA keys under {base!r} match no target_parameters entry"
                )
            continue  # a plain target_modules LoRA
        if sorted(by_depth) != list(range(len(by_depth))) or len(by_depth) != len(cands):
            raise LoRAFormatError(
                f"adapter {f}: {base!r} has {len(by_depth)} nested LoRA(s) but target_parameters names "
                f"{len(cands)} parameter(s) there ({', '.join(cands)}); the file does not match its config"
            )
        if len(cands) > 2:
            raise LoRAUnsupportedFeatureError(
                f"adapter {f}: more than two target_parameters on {base!r} are not supported"
            )
        cands.sort(key=EXPERT_PARAMS.index)
        keys = [by_depth[d] for d in sorted(by_depth, reverse=True)]  # innermost (first registered) first
        if len(keys) == 2:
            (a0, b0), (a1, b1) = ((parts[k].get("lora_A"), parts[k].get("lora_B")) for k in keys)
            if all(t is not None for t in (a0, b0, a1, b1)) and cands[0] == "gate_up_proj":
                if not _fits_gated(a0, b0, a1, b1) and _fits_gated(a1, b1, a0, b0):
                    keys.reverse()
        out.update((k, f"{base}.{c}") for k, c in zip(keys, cands))
    return out
