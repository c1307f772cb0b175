"""LoRA errors. Every message names the adapter (file), the module and the fix."""

from __future__ import annotations


class LoRAError(ValueError):
    """Base class: the adapter cannot be served as given; nothing was registered."""


class LoRAAdapterNotFoundError(LoRAError):
    pass


class LoRAFormatError(LoRAError):
    """Missing or malformed files, bad JSON, a tensor key we cannot read."""


class LoRAUnsupportedFeatureError(LoRAError):
    """A PEFT feature loraserve does not serve yet (refused, never silently dropped)."""


class LoRARankError(LoRAError):
    """The adapter's rank exceeds max_lora_rank, or the tensors disagree with the config's r."""


class LoRAShapeError(LoRAError):
    """A LoRA tensor does not fit the base module it targets."""


class LoRAUnknownModuleError(LoRAError):
    """The adapter names a module the model lacks, or one that cannot carry LoRA here."""


class UnknownAdapterError(LoRAError, KeyError):
    """A request names an adapter that is not registered (or was removed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else "unknown adapter"
