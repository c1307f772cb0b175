"""ServerConfig: the HTTP server's settings, checked on construction; ``loraserve serve``'s flags take
their defaults from here (``default(name)``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.config import ConfigError
from loraserve.sampling import MAX_STOP_STRING_LENGTH, MAX_STOP_STRINGS


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # default: the engine's model name
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None
    lora_modules: list[tuple[str, str]] = field(
        default_factory=list
    )  # loaded at startup (not checked against lora_root)
    max_n: int = 8
    # NOTE: 8 MiB holds a prompt of ~2M tokens of text, or ~1M token ids as JSON, far past today's
    # context lengths; a 10 MB body is refused (413) before a byte of it is parsed. Bodies over
    # ``prepare.OFF_LOOP_BYTES`` are parsed and tokenized off the event loop.
    max_request_bytes: int = 8 * 2**20
    max_prompts_per_request: int = 128  # prompts in one /v1/completions batch
    max_stop_strings: int = 32  # per request (SamplingParams' ceiling: MAX_STOP_STRINGS)
    max_stop_string_length: int = 256  # characters (SamplingParams' ceiling: MAX_STOP_STRING_LENGTH)

    def __post_init__(self) -> None:
        def in_range(name: str, lo: int, hi: int | None = None) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
                flag = "--" + name.replace("_", "-")
                bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise ConfigError(f"{flag} must be an integer {bounds}, got {v!r}")

        in_range("max_n", 1)
        in_range("max_request_bytes", 1024)
        in_range("max_prompts_per_request", 1)
        in_range("max_stop_strings", 0, MAX_STOP_STRINGS)
        in_range("max_stop_string_length", 1, MAX_STOP_STRING_LENGTH)
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key is empty; pass a key or leave the flag out")
        if self.allow_runtime_lora_updating and self.lora_root is None:
            raise ConfigError(
                "--allow-runtime-lora-updating needs --lora-root DIR: runtime loads are confined to that directory"
            )
        if self.lora_root is not None and not Path(self.lora_root).expanduser().is_dir():
            raise ConfigError(f"--lora-root {self.lora_root} is not a directory")


def default(name: str):
    """ServerConfig's default for field ``name`` (the serve flags' one definition)."""
    return next(f.default for f in dataclasses.fields(ServerConfig) if f.name == name)
