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


class LoRAValueError(LoRAError):
    """Values that cannot be served: NaN or inf in a tensor or the config, or magnitudes that could
    overflow (``checks.py``)."""


class LoRAPathError(LoRAError):
    """An adapter path that escapes its ``--lora-root`` (symlinks followed), or a file that is not a
    regular file."""


class LoRAChangedError(LoRAError):
    """A registered adapter's files changed on disk (real path or sha256) since registration: an id is
    one set of weights, so the re-read is refused rather than served under the old registration."""


class LoRALoadCancelledError(LoRAError):
    """Loading stopped because the manager is closing (shutdown)."""


class UnknownAdapterError(LoRAError, KeyError):
    """A request names an adapter that is not registered (or was removed)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0] if self.args else "unknown adapter"
