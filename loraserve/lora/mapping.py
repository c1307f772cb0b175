"""Module path <-> adapter key mapping.

For every module of our model that can carry LoRA we compute the adapter module names it takes, in
slice order: a packed ``qkv_proj`` takes ``q_proj, k_proj, v_proj`` (missing pieces are zeros), an
lm_head LoRA lands on the logits processor. The model's hooks (``should_apply_lora``,
``map_lora_module_name``) and the user's ``lora_target_modules`` decide. Mapping is by full module
path, so two stacks with the same layer names never collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from loraserve.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from loraserve.layers.moe import FusedMoE
from loraserve.layers.vocab import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from loraserve.models.interfaces import SupportsLoRA


@dataclass
class LoRATarget:
    path: str  # our module path, e.g. model.layers.0.self_attn.qkv_proj
    module: nn.Module
    packed: list[str]  # packed_modules_list for can_replace_layer, e.g. [q_proj, k_proj, v_proj]
    pieces: list[str | None]  # adapter module names per slice; None = restricted away by the user


def matches_target(name: str, targets: list[str]) -> bool:
    """PEFT's list rule: equal, or a suffix that starts at a dot."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _is_lora_base(module: nn.Module) -> bool:
    if isinstance(module, ParallelLMHead):
        return False  # its LoRA lives on the logits processor
    return isinstance(module, (LinearBase, VocabParallelEmbedding, LogitsProcessor, FusedMoE))


def find_lora_targets(model: nn.Module, lora_target_modules: list[str] | None) -> tuple[list[LoRATarget], set[str]]:
    """(modules to wrap, adapter module names that exist but were excluded by lora_target_modules)."""
    hooks = model if isinstance(model, SupportsLoRA) else SupportsLoRA()
    packed_map = getattr(model, "packed_modules_mapping", {})
    targets, restricted = [], set()
    for path, module in model.named_modules():
        if not _is_lora_base(module) or not hooks.should_apply_lora(path):
            continue
        adapter_name = hooks.map_lora_module_name(path)
        if adapter_name is None:
            continue
        parent, _, last = adapter_name.rpartition(".")
        packed = [last]
        if isinstance(module, (MergedColumnParallelLinear, QKVParallelLinear)):
            # packing rules apply only to packed layers whose slice count matches, so an unpacked
            # namesake in another stack (a tower's fused qkv_proj) keeps its own name
            pieces_rule = packed_map.get(path.rpartition(".")[2])
            n_out = 3 if isinstance(module, QKVParallelLinear) else len(module.output_sizes)
            if pieces_rule is not None and len(pieces_rule) == n_out:
                packed = pieces_rule
        if isinstance(module, FusedMoE):  # LoRA on its 3-D parameters, named by parameter path (target_parameters)
            parent, packed = adapter_name, list(module.hf_param_names)
        pieces: list[str | None] = [f"{parent}.{p}" if parent else p for p in packed]
        if lora_target_modules:
            restricted.update(p for p in pieces if not matches_target(p, lora_target_modules))
            pieces = [p if matches_target(p, lora_target_modules) else None for p in pieces]
            if all(p is None for p in pieces):
                continue
        targets.append(LoRATarget(path, module, packed, pieces))
    return targets, restricted


def describe_unknown_module(model: nn.Module, name: str, restricted: set[str]) -> str:
    """Why an adapter module has no home in this model, and the fix."""
    if name in restricted:
        return f"module {name!r} is excluded by --lora-target-modules; add it there or drop it from the adapter"
    module_names = dict(model.named_modules())
    if name in module_names:
        return f"module {name!r} exists but cannot carry LoRA in loraserve ({type(module_names[name]).__name__})"
    last = name.rpartition(".")[2]
    for path in module_names:
        for packed_as, pieces in getattr(model, "packed_modules_mapping", {}).items():
            if last in pieces and path.endswith("." + packed_as):
                return (
                    f"the model has no module {name!r} (was the adapter trained for another model, "
                    f"or another number of layers?)"
                )
    return f"the model has no module {name!r}; was the adapter trained for another base model?"
