"""OpenAI-compatible request and response schemas (pydantic v2).

Requests forbid unknown fields: a parameter we do not implement is refused with a 400 naming it,
never silently dropped. OpenAI parameters that exist but that we do not implement are declared and
refused when set to anything but their neutral value (see ``unsupported()``). vLLM's sampling
extensions (top_k, min_p, min_tokens, ignore_eos, stop_token_ids, ...) are accepted as extra fields,
with the openai client's ``extra_body``.

Numbers must be finite (``NaN`` / ``Infinity``, which Python's JSON reader accepts, are a 400 naming
the field); ranges are checked by ``SamplingParams`` and the server (``validation.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- errors ---------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared pieces --------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingFields(_Request):
    """Fields both endpoints share; names follow OpenAI, then vLLM's extensions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None  # an end-user id for the caller's own logs; not used
    # OpenAI parameters we do not implement: refused unless neutral
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI's range
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM sampling extensions
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def unsupported(self) -> list[str]:
        """Names of set parameters that loraserve does not implement."""
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


# ---- /v1/completions ------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _one_prompt_shape(cls, v: Any) -> str | list:
        """One of the four shapes, told by the first element, token ids strictly ints.

        NOTE: replaces pydantic's union, which on a list of a million ids validates it against every
        member (~0.4 s holding the GIL) before settling on ``list[int]``."""
        if isinstance(v, str):
            return v
        shapes = "a string, a list of strings, a list of token ids or a list of lists of token ids"
        if not isinstance(v, list):
            raise ValueError(f"prompt must be {shapes}")
        if not v:
            return v
        first = v[0]
        if isinstance(first, str):
            ok, what = all(isinstance(x, str) for x in v), "strings"
        elif type(first) is int:
            ok, what = all(type(x) is int for x in v), "token ids (integers)"
        elif isinstance(first, list):
            ok = all(isinstance(p, list) and all(type(x) is int for x in p) for p in v)
            what = "lists of token ids (integers)"
        else:
            raise ValueError(f"prompt must be {shapes}, got a list of {type(first).__name__}")
        if not ok:
            raise ValueError(f"prompt must be {shapes}: the list mixes {what} with other values")
        return v

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.suffix:
            bad.append("suffix")
        return bad


class CompletionLogProbs(_Response):
    """OpenAI's legacy completions format: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


# ---- /v1/chat/completions -------------------------------------------------------------------------
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates may read extra keys (name, ...)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # OpenAI parameters we do not implement
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            bad.append("response_format")
        return bad


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models and adapters ----------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loraserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class LoadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM compatibility; the name decides
