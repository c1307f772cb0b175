"""LoRARequest: which adapter a request uses (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0; the identity of these weights (a reload with new weights needs a new id)
    lora_path: str = ""  # "" = refer to an adapter already registered under this id

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")
