"""Per-request state. A request with n > 1 owns n sequences that share its prompt."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from loraserve.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None
    seed: int | None = None  # sampling seed (the request's seed + index); None = the engine's generator
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # filled once, during the first prefill
    # position -> logprobs of prompt token position + 1; chunked prefill fills it piece by piece
    prompt_logprobs_by_pos: dict = field(default_factory=dict)
    logprobs: SampleLogprobs | None = None
    text: str = ""
    prefix_offset: int = 0  # incremental detokenization window
    read_offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    generator: torch.Generator | None = field(default=None, init=False, repr=False)
    banned_ids: torch.Tensor | None = field(
        default=None, init=False, repr=False
    )  # stop ids before min_tokens

    def __post_init__(self) -> None:
        self.prefix_offset = max(len(self.prompt_token_ids) - 5, 0)
        self.read_offset = len(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """The seeded generator, made on the sampling ``device`` at first use; None when unseeded."""
        if self.seed is not None and self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """``token_ids[start:end]`` without building the whole prompt + output list (a per-step cost
        that grows with the context, paid for every running sequence)."""
        p = self.prompt_token_ids
        n = len(p)
        if start >= n:
            return self.output_token_ids[start - n : None if end is None else end - n]
        if end is not None and end <= n:
            return p[start:end]
        return p[start:] + self.output_token_ids[: None if end is None else end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    seqs: list[Sequence]
    error: str | None = None  # why the engine failed the request (finish_reason "error")

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """A snapshot of the request, shaped like vLLM's RequestOutput."""
        outs = [
            CompletionOutput(
                index=s.index,
                text=s.text,
                token_ids=list(s.output_token_ids),
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in self.seqs
        ]
        first_token = [s.first_token_time for s in self.seqs if s.first_token_time]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.seqs[0].prompt_logprobs,
            outputs=outs,
            finished=self.finished,
            lora_request=self.lora_request,
            metrics={
                "arrival_time": min(s.arrival_time for s in self.seqs),
                "first_token_time": min(first_token, default=None),
            },
            error=self.error,
        )
