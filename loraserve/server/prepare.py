"""The CPU work of a generation request before the engine sees it: parse the body, check every field,
tokenize, build each prompt's SamplingParams. Anything wrong is an ``APIError`` (4xx) naming the field.

Bodies up to ``OFF_LOOP_BYTES`` are prepared on the event loop; larger ones on one worker thread, so
a multi-megabyte prompt (seconds of tokenization) never stalls ``/health`` or the other streams.
Each thread has its own tokenizer instance (the engine thread has a third): none is shared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from transformers import AutoTokenizer

from loraserve.daemon_worker import DaemonWorker
from loraserve.sampling import MAX_LOGPROBS, SamplingParams
from loraserve.server.errors import APIError
from loraserve.server.protocol import ChatCompletionRequest, CompletionRequest
from loraserve.server.server_config import ServerConfig
from loraserve.server.validation import check_stop, check_token_ids, parse_body

# NOTE: 16 KiB of text tokenizes in ~10 ms: more than a thread hop costs, less than a noticeable stall
OFF_LOOP_BYTES = 16 * 1024


@dataclass
class Prompt:
    text: str | None  # None: given as token ids
    ids: list[int]
    echo: str | None = None  # the prompt as text, when the request echoes it


@dataclass
class Prepared:
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per prompt


class Preparer:
    def __init__(
        self, model_root: str, model_name: str, vocab_size: int, max_model_len: int, config: ServerConfig
    ):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(model_root)  # the loop thread's
        self._worker_tokenizer = AutoTokenizer.from_pretrained(model_root)  # the worker thread's
        self._worker = DaemonWorker(
            "loraserve-prepare",
            lambda: APIError(503, "the server is shutting down; retry on another replica"),
        )

    def close(self) -> None:
        self._worker.shutdown()

    async def _run(self, body: bytes, fn: Callable[..., Prepared], content_type: str | None) -> Prepared:
        if len(body) <= OFF_LOOP_BYTES:
            return fn(self.tokenizer, body, content_type)
        return await asyncio.wrap_future(self._worker.submit(fn, self._worker_tokenizer, body, content_type))

    async def completion(self, body: bytes, content_type: str | None) -> Prepared:
        return await self._run(body, self._completion, content_type)

    async def chat(self, body: bytes, content_type: str | None) -> Prepared:
        return await self._run(body, self._chat, content_type)

    # ---- shared pieces (any thread: they touch only the tokenizer they are given) ----------------
    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        bad = req.unsupported()
        if bad:
            raise APIError(
                400,
                f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not supported by loraserve; leave "
                f"{'it' if len(bad) == 1 else 'them'} unset",
                bad[0],
            )
        if not 1 <= req.n <= self.config.max_n:
            raise APIError(
                400, f"n must be in [1, {self.config.max_n}], got {req.n} (the server's --max-n)", "n"
            )
        check_stop(req.stop, self.config.max_stop_strings, self.config.max_stop_string_length)
        if req.stop_token_ids:
            check_token_ids("stop_token_ids", req.stop_token_ids, self.vocab_size)

    def _check_prompt(self, ids: list[int], where: str) -> None:
        if not ids:
            raise APIError(400, f"{where} is empty (no tokens); pass some text or token ids", "prompt")
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but {where} has "
                f"{len(ids)} (prompt + at least one new token must fit); shorten the prompt",
                "prompt" if where.startswith("prompt") else "messages",
            )
        check_token_ids(where, ids, self.vocab_size)

    def _params(
        self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        if max_tokens is None:
            max_tokens = max(self.max_model_len - prompt_len, 1)
        if max_tokens >= 1 and prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt + max_tokens={max_tokens}); shorten the "
                f"prompt or lower max_tokens",
                "max_tokens",
            )
        return SamplingParams(
            n=req.n,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )

    # ---- /v1/completions ------------------------------------------------------------------------
    def _completion(self, tok, body: bytes, content_type: str | None) -> Prepared:
        req = parse_body(body, content_type, CompletionRequest)
        self._check_common(req)
        lp = req.logprobs
        if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {lp}", "logprobs")
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(
                400, "prompt is an empty list; pass a string, a list of strings or token ids", "prompt"
            )
        if len(prompt) > self.config.max_prompts_per_request:
            raise APIError(
                400,
                f"prompt holds {len(prompt)} prompts; this server accepts at most "
                f"{self.config.max_prompts_per_request} per request (--max-prompts-per-request)",
                "prompt",
            )
        prompts = []
        for i, p in enumerate(prompt):
            where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                ids = tok.encode(p)
                self._check_prompt(ids, where)
                prompts.append(Prompt(p, ids, p if req.echo else None))
            else:
                self._check_prompt(p, where)
                prompts.append(Prompt(None, list(p), tok.decode(p) if req.echo else None))
        prompt_lp = lp if req.echo and lp is not None else None
        params = [self._params(req, len(p.ids), req.max_tokens, lp, prompt_lp) for p in prompts]
        return Prepared(req, prompts, params)

    # ---- /v1/chat/completions -------------------------------------------------------------------
    def _chat(self, tok, body: bytes, content_type: str | None) -> Prepared:
        req = parse_body(body, content_type, ChatCompletionRequest)
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        prompt = self._chat_prompt(tok, req)
        self._check_prompt(prompt.ids, "the conversation")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, len(prompt.ids), max_tokens, top if req.logprobs else None, None)
        return Prepared(req, [prompt], [params])

    def _chat_prompt(self, tok, req: ChatCompletionRequest) -> Prompt:
        if not req.messages:
            raise APIError(400, "messages is empty", "messages")
        if tok.chat_template is None:
            raise APIError(400, f"the model {self.model_name} has no chat template; use /v1/completions")
        conv = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(
                            400,
                            f"message content part of type {part.get('type')!r} is not supported; "
                            f"only text parts",
                            "messages",
                        )
                    parts.append(part["text"])
                content = "\n".join(parts)
            d["content"] = content or ""
            conv.append(d)
        kw = dict(add_generation_prompt=req.add_generation_prompt)
        try:
            ids = tok.apply_chat_template(conv, tokenize=True, **kw)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            text = tok.apply_chat_template(conv, tokenize=False, **kw)
        except Exception as e:  # the template itself may reject a conversation (roles out of order, ...)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e
        return Prompt(text, list(ids))
