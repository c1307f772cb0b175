"""LoRARequest: which adapter a request uses (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0; the identity of these weights (a reload with new weights needs a new id)
    lora_path: str = ""  # "" = refer to an adapter already registered under this id
    # the dir lora_path was confined to (the server's --lora-root): every read of the adapter's files, the
    # first and each one after a host-cache eviction, must resolve under it (lora/files.py ``confine``)
    lora_root: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}")


@dataclass(frozen=True)
class LoRAMixture(LoRARequest):
    """A per-request mixture of 2-4 registered-or-on-disk adapters, served as one adapter identity.

    ``combination``: "linear" = sum_i w_i * dW_i exactly (ranks concatenated, PEFT's "cat");
    "ties", "dare_linear", "dare_ties" = PEFT's add_weighted_adapter rules applied to A and B
    (equal ranks; ``density`` = fraction kept; DARE's random drop is seeded by ``seed``).
    """

    components: tuple[tuple[LoRARequest, float], ...] = ()
    combination: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= len(self.components) <= 4:
            raise ValueError(f"a mixture names 2 to 4 adapters, got {len(self.components)}")
        if self.combination not in ("linear", "ties", "dare_linear", "dare_ties"):
            raise ValueError(
                f"unknown combination {self.combination!r}; use linear, ties, dare_linear or dare_ties"
            )
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density}")
