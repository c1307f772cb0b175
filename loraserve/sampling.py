"""SamplingParams, with vLLM's names and checks."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    pass


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = until max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> SamplingParamsError:
            return SamplingParamsError(msg)

        if self.n < 1:
            raise bad(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise bad(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        if any(not s for s in self.stop_list):
            raise bad("stop strings must be non-empty")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
