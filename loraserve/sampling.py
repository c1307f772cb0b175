"""SamplingParams, with vLLM's names; every field is checked on construction, for ``LLM`` and the server alike.

A bad value raises ``SamplingParamsError`` naming the field (``.param``) and the range it must lie in,
so no request reaches the sampler with a value that could make it fail (NaN / inf temperatures,
seeds torch cannot take, unbounded stop lists).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
# NOTE: 1e4 already flattens any real model's logits to a near-uniform distribution, and it is below
# fp16's largest value (65504): the sampler's fp32 temperature table and logits / temperature stay
# finite, and a filtered logit stays -inf. 1e39 overflowed the fp32 table to inf, and -inf / inf is NaN.
MAX_TEMPERATURE = 1e4
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (argmax)
# NOTE: a smaller top_p is raised to this: in the sampler's fp32 table 5e-324 became 0, which filtered
# out every token (NaN probabilities). Same tokens kept: the first token's mass, >= 1/vocab, exceeds it.
MIN_TOP_P = 1e-8
# NOTE: the ceilings of the stop lists, for everyone (the server's --max-stop-strings and
# --max-stop-string-length can only lower them): the engine searches every stop string after each
# token in a window of the string's length, so a sequence's per-token cost grows with count x length;
# stop token ids are looked up per step.
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


class SamplingParamsError(ValueError):
    """A sampling parameter out of its range; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _int(name: str, v, lo: int, hi: int, hint: str = "") -> int:
    """``v`` as an int in [lo, hi] (bools and floats refused: ``n=True`` or ``top_k=2.5`` is a bug)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise SamplingParamsError(f"{name} must be an integer, got {v!r}", name)
    v = int(v)
    if not lo <= v <= hi:
        raise SamplingParamsError(f"{name} must be in [{lo}, {hi}]{hint}, got {v}", name)
    return v


def _float(name: str, v, lo: float, hi: float, lo_open: bool = False, hint: str = "") -> float:
    """``v`` as a finite float in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise SamplingParamsError(f"{name} must be a number, got {v!r}", name)
    v = float(v)
    ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise SamplingParamsError(f"{name} must be a finite number in {interval}{hint}, got {v!r}", name)
    return v


def _bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise SamplingParamsError(f"{name} must be true or false, got {v!r}", name)
    return v


def _stop_strings(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)):
        raise SamplingParamsError(
            f"stop must be a string or a list of strings, got {type(stops).__name__}", "stop"
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise SamplingParamsError(
            f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted", "stop"
        )
    for s in stops:
        if not isinstance(s, str) or not s:
            raise SamplingParamsError(f"stop strings must be non-empty strings, got {s!r}", "stop")
        if len(s) > MAX_STOP_STRING_LENGTH:
            raise SamplingParamsError(
                f"a stop string has {len(s)} characters; at most {MAX_STOP_STRING_LENGTH} are accepted",
                "stop",
            )
        if not s.isascii():
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise SamplingParamsError(
                    f"stop string {s!r} is not valid Unicode (a lone surrogate); send UTF-8 text", "stop"
                ) from None
    return list(stops)


def _stop_token_ids(ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise SamplingParamsError(
            f"stop_token_ids must be a list of token ids, got {type(ids).__name__}", "stop_token_ids"
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingParamsError(
            f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted", "stop_token_ids"
        )
    # the upper bound is the vocabulary, which only the engine knows: it checks that
    return [_int("stop_token_ids", t, 0, INT64_MAX) for t in ids]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 (or < 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # completion i uses seed + i
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
        """Check every field and normalise its type (ints to int, numbers to float, stop to ``stop_list``)."""
        self.n = _int("n", self.n, 1, INT64_MAX)
        self.temperature = _float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, hint=" (0 = greedy)")
        self.top_p = max(_float("top_p", self.top_p, 0.0, 1.0, lo_open=True, hint=" (1 = off)"), MIN_TOP_P)
        self.top_k = _int("top_k", self.top_k, -1, INT64_MAX, hint=" (0 or -1 = off)")
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p, 0.0, 1.0, hint=" (0 = off)")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, SEED_MIN, SEED_MAX, hint=" (64-bit)")
            if self.seed + self.n - 1 > SEED_MAX:
                raise SamplingParamsError(
                    f"seed + n - 1 = {self.seed + self.n - 1} exceeds {SEED_MAX}: completion i uses seed + i, "
                    f"which must fit 64 bits; pass a seed <= {SEED_MAX - self.n + 1}",
                    "seed",
                )
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1, INT64_MAX)
        hi = INT64_MAX if self.max_tokens is None else self.max_tokens
        self.min_tokens = _int("min_tokens", self.min_tokens, 0, hi, hint=" (at most max_tokens)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, _int(name, v, 0, MAX_LOGPROBS))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _bool(name, getattr(self, name))
        self.stop_list = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
