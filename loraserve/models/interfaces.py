"""What a model class tells the LoRA system (SGLang #6608's hooks, with defaults).

- ``packed_modules_mapping``: fused module -> the HF modules packed in it, in order.
- ``should_apply_lora(module_name)``: may this module (full path in our model) carry LoRA?
- ``map_lora_module_name(module_name)``: the adapter key prefix for a module (its HF path), or None
  for no LoRA. Mapping is by full path, so two stacks with the same layer names never collide.
"""

from __future__ import annotations


class SupportsLoRA:
    packed_modules_mapping: dict[str, list[str]] = {}
    # our module path suffix -> the name adapters use for it
    lora_module_aliases: dict[str, str] = {"logits_processor": "lm_head"}

    def should_apply_lora(self, module_name: str) -> bool:
        return True

    def map_lora_module_name(self, module_name: str) -> str | None:
        head, _, last = module_name.rpartition(".")
        alias = self.lora_module_aliases.get(last)
        if alias is None:
            return module_name
        return f"{head}.{alias}" if head else alias
