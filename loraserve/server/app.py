"""The OpenAI-compatible HTTP server: ``build_app(engine, config)`` returns a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as SSE), GET /v1/models,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /health, GET /metrics.

The request's ``model`` picks the adapter: the base model's name (or none) means no adapter.
Errors use OpenAI's body ``{"error": {"message", "type", "code"}}``. Safe by default: ``api_key``
guards every /v1 route; runtime adapter loading is off unless enabled, and then a ``lora_path``
must resolve (symlinks included, for the dir and every file in it) under ``lora_root``.

Threads: the handlers run on the event loop; the engine runs on its own thread (``AsyncEngine``).
The server tokenizes with its own tokenizer instance, so the engine's is used on its thread only.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from transformers import AutoTokenizer

from loraserve.config import ConfigError
from loraserve.engine.engine import LLMEngine, RequestError
from loraserve.lora.errors import LoRAError, UnknownAdapterError
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from loraserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    GenRequest,
    RequestStream,
    UnknownModelError,
)
from loraserve.server.metrics import ServerMetrics, engine_stats
from loraserve.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TopLogprob,
    UnloadLoRAAdapterRequest,
    UsageInfo,
    random_id,
)

logger = logging.getLogger(__name__)

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/metrics",
)
_ADAPTER_NAME = re.compile(r"^[\w.:@+-][\w.:/@+-]{0,127}$")
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


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

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("--api-key is empty; pass a key or leave the flag out")
        if self.allow_runtime_lora_updating and self.lora_root is None:
            raise ConfigError(
                "--allow-runtime-lora-updating needs --lora-root DIR: runtime loads are confined to that directory"
            )
        if self.lora_root is not None and not Path(self.lora_root).expanduser().is_dir():
            raise ConfigError(f"--lora-root {self.lora_root} is not a directory")


class APIError(Exception):
    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorInfo(
            message=message, type=APIError.TYPES.get(status, "APIError"), code=status, param=param
        )
    )


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


def as_api_error(e: BaseException) -> APIError:
    """Map engine / adapter / sampling errors to HTTP statuses."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (UnknownModelError, UnknownAdapterError)):
        return APIError(404, str(e))
    if isinstance(e, (RequestError, SamplingParamsError, LoRAError)):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e))
    logger.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {e!r}")


# ---- middleware: API key + request counts ---------------------------------------------------------
class _Guard:
    """Pure ASGI (a BaseHTTPMiddleware would get in the way of streaming and disconnects)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ROUTES else "other"
        status = "500"

        async def send_and_count(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = str(msg["status"])
            await send(msg)

        try:
            if self.key is not None and path.startswith("/v1"):
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not secrets.compare_digest(given, self.key):
                    msg = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                    return await error_response(401, msg)(scope, receive, send_and_count)
            await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.requests[(endpoint, status)] += 1


class _SSEResponse(StreamingResponse):
    """Aborts the engine requests when the stream ends for any reason (client gone included)."""

    def __init__(self, content, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


def _sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(stream: RequestStream, request: Request) -> dict[int, RequestOutput] | None:
    """The final output of every prompt; None if the client disconnected first (requests aborted)."""

    async def consume() -> dict[int, RequestOutput]:
        last: dict[int, RequestOutput] = {}
        async for i, out in stream:
            last[i] = out
        return last

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        watcher.cancel()
        task.cancel()
        stream.abort()


# ---- logprobs formats -----------------------------------------------------------------------------
def _clamp(lp: float) -> float:
    return max(lp, _MIN_LOGPROB)


def _legacy_logprobs(pairs, offset: int, decode) -> tuple[CompletionLogProbs, int]:
    """OpenAI completions logprobs for (token_id, {id: Logprob} | None) pairs; offsets start at ``offset``."""
    lp = CompletionLogProbs()
    for tid, d in pairs:
        if d is None:  # the first prompt token has no logprob
            tok, val, top = decode([tid]), None, None
        else:
            tok = d[tid].decoded_token
            val = _clamp(d[tid].logprob)
            top = {v.decoded_token: _clamp(v.logprob) for v in sorted(d.values(), key=lambda v: v.rank)}
        lp.tokens.append(tok if tok is not None else "")
        lp.token_logprobs.append(val)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(tok or "")
    return lp, offset


def _chat_logprobs(token_ids: list[int], dicts, top_k: int) -> ChatLogprobs:
    content = []
    for tid, d in zip(token_ids, dicts):
        tok = d[tid].decoded_token or ""
        top = [v for v in sorted(d.values(), key=lambda v: v.rank) if v.rank <= top_k][:top_k]
        content.append(
            ChatTokenLogprob(
                token=tok,
                logprob=_clamp(d[tid].logprob),
                bytes=list(tok.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=v.decoded_token or "",
                        logprob=_clamp(v.logprob),
                        bytes=list((v.decoded_token or "").encode()),
                    )
                    for v in top
                ],
            )
        )
    return ChatLogprobs(content=content)


def _usage(prompt_lens: list[int], outs: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outs.values() for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@dataclass
class _Prompt:
    text: str | None
    ids: list[int]


class _Delta:
    """Per-choice streaming state: text is held back by (longest stop string - 1) chars until the end,
    so that a stop string found later, which truncates the text, never cuts text already sent."""

    def __init__(self, holdback: int):
        self.holdback = holdback
        self.chars = 0
        self.tokens = 0
        self.done = False

    def advance(self, c: CompletionOutput) -> tuple[str, list[int], list]:
        end = len(c.text) if c.finished else max(len(c.text) - self.holdback, self.chars)
        text = c.text[self.chars : end]
        new_ids = c.token_ids[self.tokens :]
        new_lps = c.logprobs[self.tokens :] if c.logprobs is not None else []
        self.chars, self.tokens = end, len(c.token_ids)
        self.done = c.finished
        return text, new_ids, new_lps


# ---- the app --------------------------------------------------------------------------------------
class _Server:
    """Request handling; one per app."""

    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.config = config
        self.model_name = config.served_model_name or engine.model_name
        self.model_root = str(engine.model_dir)
        self.max_model_len = engine.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_root)  # the loop thread's own copy
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(engine, {self.model_name}, self.metrics)
        self.lora_root = Path(config.lora_root).expanduser().resolve() if config.lora_root else None
        for name, path in config.lora_modules:
            try:
                self._check_adapter_name(name)
            except APIError as e:
                raise ConfigError(f"--lora-modules {name}={path}: {e.message}") from None
            self.engine.load_adapter_now(name, str(Path(path).expanduser().resolve()))

    # ---- shared request pieces ------------------------------------------------------------------
    def _check_common(self, req) -> None:
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

    async def _submit(
        self, model: str | None, prompts: list[_Prompt], params: list[SamplingParams], prefix: str
    ) -> RequestStream:
        base = uuid.uuid4().hex
        reqs = [
            GenRequest(f"{prefix}-{base}-{i}", p.text, p.ids, sp)
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        stream = await self.engine.add(reqs, model)
        self.metrics.adapter_requests[model or self.model_name] += 1
        return stream

    @staticmethod
    def _holdback(params: SamplingParams) -> int:
        return max((len(s) for s in params.stop_list), default=1) - 1

    # ---- /v1/completions ------------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[_Prompt]:
        if isinstance(prompt, str):
            return [_Prompt(prompt, self.tokenizer.encode(prompt))]
        if not prompt:
            raise APIError(
                400, "prompt is an empty list; pass a string, a list of strings or token ids", "prompt"
            )
        if isinstance(prompt[0], str):
            return [_Prompt(p, self.tokenizer.encode(p)) for p in prompt]
        if isinstance(prompt[0], int):
            return [_Prompt(None, list(prompt))]
        return [_Prompt(None, list(p)) for p in prompt]

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        prompts = self._completion_prompts(req.prompt)
        lp = req.logprobs
        if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {lp}", "logprobs")
        params = [
            self._params(req, len(p.ids), req.max_tokens, lp, lp if req.echo and lp is not None else None)
            for p in prompts
        ]
        stream = await self._submit(req.model, prompts, params, "cmpl")
        model = req.model or self.model_name
        if req.stream:
            return _SSEResponse(self._completion_events(req, model, stream, prompts, params[0]), stream)
        outs = await _collect(stream, raw)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, p in enumerate(prompts):
            for c in outs[i].outputs:
                text, logprobs, offset = c.text, None, 0
                pairs = list(zip(c.token_ids, c.logprobs)) if lp is not None else []
                if req.echo:
                    echo = self._echo_text(p)
                    text = echo + text
                    if lp is not None:
                        pairs = list(zip(p.ids, outs[i].prompt_logprobs)) + pairs
                if lp is not None:
                    logprobs, offset = _legacy_logprobs(pairs, offset, self.tokenizer.decode)
                choices.append(
                    CompletionChoice(
                        index=i * req.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        resp = CompletionResponse(
            model=model, choices=choices, usage=_usage([len(p.ids) for p in prompts], outs)
        )
        return Response(resp.model_dump_json(), media_type="application/json")

    def _echo_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.ids)

    async def _completion_events(
        self, req: CompletionRequest, model: str, stream: RequestStream, prompts, params
    ):
        rid, created, lp = random_id("cmpl"), int(time.time()), req.logprobs
        states: dict[int, _Delta] = {}
        offsets: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in stream:
                last[i] = out
                choices = []
                for c in out.outputs:
                    idx = i * req.n + c.index
                    st = states.get(idx)
                    first = st is None
                    if first:
                        st = states[idx] = _Delta(self._holdback(params))
                    if st.done:
                        continue
                    text, new_ids, new_lps = st.advance(c)
                    pairs = list(zip(new_ids, new_lps)) if lp is not None else []
                    if first and req.echo:
                        text = self._echo_text(prompts[i]) + text
                        if lp is not None:
                            pairs = list(zip(prompts[i].ids, out.prompt_logprobs)) + pairs
                    logprobs = None
                    if lp is not None:
                        logprobs, offsets[idx] = _legacy_logprobs(
                            pairs, offsets.get(idx, 0), self.tokenizer.decode
                        )
                    if text or pairs or c.finished:
                        choices.append(
                            CompletionChoice(
                                index=idx,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                if choices:
                    yield _sse(
                        CompletionStreamResponse(id=rid, created=created, model=model, choices=choices)
                    )
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = _usage([len(p.ids) for p in prompts], last)
                yield _sse(
                    CompletionStreamResponse(id=rid, created=created, model=model, choices=[], usage=usage)
                )
        except Exception as e:
            err = as_api_error(e)
            yield f"data: {error_body(err.status, err.message).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions -------------------------------------------------------------------
    def _chat_prompt(self, req: ChatCompletionRequest) -> _Prompt:
        if not req.messages:
            raise APIError(400, "messages is empty", "messages")
        if self.tokenizer.chat_template is None:
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
            ids = self.tokenizer.apply_chat_template(conv, tokenize=True, **kw)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, **kw)
        except Exception as e:  # the template itself may reject a conversation (roles out of order, ...)
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from e
        return _Prompt(text, list(ids))

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        prompt = self._chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, len(prompt.ids), max_tokens, top if req.logprobs else None, None)
        stream = await self._submit(req.model, [prompt], [params], "chatcmpl")
        model = req.model or self.model_name
        if req.stream:
            return _SSEResponse(self._chat_events(req, model, stream, prompt, params), stream)
        outs = await _collect(stream, raw)
        if outs is None:
            return Response(status_code=499)
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=_chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in outs[0].outputs
        ]
        resp = ChatCompletionResponse(model=model, choices=choices, usage=_usage([len(prompt.ids)], outs))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _chat_events(
        self, req: ChatCompletionRequest, model: str, stream: RequestStream, prompt, params
    ):
        rid, created = random_id("chatcmpl"), int(time.time())

        def chunk(choices, usage=None) -> str:
            return _sse(
                ChatCompletionStreamResponse(
                    id=rid, created=created, model=model, choices=choices, usage=usage
                )
            )

        yield chunk(
            [
                ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(req.n)
            ]
        )
        states = {i: _Delta(self._holdback(params)) for i in range(req.n)}
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in stream:
                last[i] = out
                choices = []
                for c in out.outputs:
                    st = states[c.index]
                    if st.done:
                        continue
                    text, new_ids, new_lps = st.advance(c)
                    logprobs = (
                        _chat_logprobs(new_ids, new_lps, req.top_logprobs or 0)
                        if req.logprobs and new_ids
                        else None
                    )
                    if text or logprobs or c.finished:
                        choices.append(
                            ChatCompletionStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(content=text),
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        )
                if choices:
                    yield chunk(choices)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], _usage([len(prompt.ids)], last))
        except Exception as e:
            err = as_api_error(e)
            yield f"data: {error_body(err.status, err.message).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    # ---- models and adapters --------------------------------------------------------------------
    def models(self) -> ModelList:
        cards = [ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)]
        for name, lr in sorted(self.engine.adapters.snapshot().items()):
            cards.append(ModelCard(id=name, root=lr.lora_path, parent=self.model_name))
        return ModelList(data=cards)

    def _check_adapter_name(self, name: str) -> None:
        if not _ADAPTER_NAME.match(name):
            raise APIError(
                400,
                f"lora_name {name!r} is not a valid name: use 1-128 letters, digits and . _ - : / @ +",
                "lora_name",
            )
        if name == self.model_name:
            raise APIError(400, f"lora_name {name!r} is the base model's name; pick another", "lora_name")

    def _check_runtime_updates(self) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise APIError(
                403,
                "runtime LoRA loading is disabled on this server; restart it with "
                "--allow-runtime-lora-updating --lora-root DIR",
            )

    def resolve_lora_path(self, given: str) -> str:
        """The real path of ``given`` (relative = under lora_root) if it and every file in it lie under lora_root."""
        root = self.lora_root
        p = Path(given).expanduser()
        if not p.is_absolute():
            p = root / p
        try:
            real = p.resolve(strict=True)
        except (OSError, RuntimeError):
            raise APIError(400, f"lora_path {given!r} does not exist", "lora_path") from None
        if not real.is_relative_to(root):
            raise APIError(
                400,
                f"lora_path {given!r} resolves outside --lora-root {root}; adapters must live "
                f"under it (symlinks are followed)",
                "lora_path",
            )
        if not real.is_dir():
            raise APIError(
                400, f"lora_path {given!r} is not a directory; pass a PEFT adapter dir", "lora_path"
            )
        for f in real.iterdir():
            if not f.resolve().is_relative_to(root):
                raise APIError(
                    400, f"lora_path {given!r}: {f.name} links outside --lora-root {root}", "lora_path"
                )
        return str(real)

    async def load_adapter(self, body: LoadLoRAAdapterRequest) -> JSONResponse:
        self._check_runtime_updates()
        self._check_adapter_name(body.lora_name)
        path = self.resolve_lora_path(body.lora_path)
        lr = await self.engine.load_adapter(body.lora_name, path)
        return JSONResponse(
            {
                "message": f"Success: LoRA adapter '{lr.lora_name}' added successfully.",
                "lora_name": lr.lora_name,
                "lora_int_id": lr.lora_int_id,
                "lora_path": lr.lora_path,
            }
        )

    async def unload_adapter(self, body: UnloadLoRAAdapterRequest) -> JSONResponse:
        self._check_runtime_updates()
        lr = await self.engine.unload_adapter(body.lora_name)
        return JSONResponse(
            {
                "message": f"Success: LoRA adapter '{lr.lora_name}' removed successfully.",
                "lora_name": lr.lora_name,
                "lora_int_id": lr.lora_int_id,
            }
        )

    async def render_metrics(self) -> Response:
        stats = await self.engine.call(engine_stats)
        return PlainTextResponse(self.metrics.render(stats), media_type="text/plain; version=0.0.4")


def build_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """The app; the engine thread starts with the app's lifespan (uvicorn runs it)."""
    config = config or ServerConfig()
    server = _Server(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        try:
            yield
        finally:
            server.engine.shutdown()

    app = FastAPI(title="loraserve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or "body"
            msgs.append(f"{loc}: {err.get('msg')}")
        return error_response(400, "invalid request: " + "; ".join(msgs[:5]))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _other_error(request: Request, e: Exception):
        err = as_api_error(e)
        return error_response(err.status, err.message, err.param)

    async def guarded(coro):
        try:
            return await coro
        except APIError:
            raise
        except Exception as e:
            raise as_api_error(e) from e

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await guarded(server.completions(req, raw))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await guarded(server.chat(req, raw))

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return await guarded(server.load_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return await guarded(server.unload_adapter(body))

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return error_response(503, f"the engine is not running: {server.engine.dead!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return await guarded(server.render_metrics())

    app.add_middleware(_Guard, api_key=config.api_key, metrics=server.metrics)
    return app
