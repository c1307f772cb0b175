"""HF ``architectures[0]`` -> (module, class), imported lazily."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("loraserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("loraserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("loraserve.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("loraserve.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("loraserve.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("loraserve.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("loraserve.models.mixtral", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("loraserve.models.mixtral", "OlmoeForCausalLM"),
}


class UnsupportedModelError(ValueError):
    pass


def register_model(architecture: str, module: str, cls: str) -> None:
    """Add an architecture (used by tests and plugins)."""
    _MODELS[architecture] = (module, cls)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise UnsupportedModelError("the model config has no `architectures`; cannot pick a model class")
    arch = archs[0]
    if arch not in _MODELS:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(module), cls)
