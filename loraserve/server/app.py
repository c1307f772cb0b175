"""The OpenAI-compatible HTTP server: ``build_app(engine, config)`` returns a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as SSE), GET /v1/models,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /health, GET /metrics.

The request's ``model`` picks the adapter: the base model's name (or none) means no adapter.
Errors use OpenAI's body ``{"error": {"message", "type", "code"}}`` (errors.py). Safe by default:
``api_key`` guards every /v1 route; request bodies are capped before parsing (middleware.py); every
field is checked at the boundary, so a bad request is a 4xx naming it (prepare.py, validation.py);
runtime adapter loading is off unless enabled, and then a ``lora_path`` must resolve (symlinks
included, for the dir and every file in it) under ``lora_root``.

Threads: the handlers run on the event loop; the engine runs on its own thread (``AsyncEngine``);
large request bodies are parsed and tokenized on a worker thread (``Preparer``). Each thread has its
own tokenizer instance.
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from loraserve.config import ConfigError
from loraserve.engine.engine import LLMEngine
from loraserve.outputs import RequestOutput
from loraserve.sampling import SamplingParams
from loraserve.server.async_engine import AsyncEngine, GenRequest, RequestStream
from loraserve.server.errors import APIError, as_api_error, error_body, error_response
from loraserve.server.metrics import ServerMetrics, engine_stats
from loraserve.server.middleware import Guard
from loraserve.server.prepare import Prepared, Preparer, Prompt
from loraserve.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    random_id,
)
from loraserve.server.responses import (
    Delta,
    SSEResponse,
    chat_logprobs,
    collect,
    legacy_logprobs,
    sse,
    usage,
)
from loraserve.server.server_config import ServerConfig
from loraserve.server.validation import check_adapter_name, parse_body, resolve_lora_path

__all__ = ["ServerConfig", "build_app"]


def _error_event(e: BaseException) -> str:
    err = as_api_error(e)
    return f"data: {error_body(err.status, err.message, err.param).model_dump_json()}\n\n"


class _Server:
    """Request handling; one per app."""

    def __init__(self, engine: LLMEngine, config: ServerConfig):
        self.config = config
        self.model_name = config.served_model_name or engine.model_name
        self.model_root = str(engine.model_dir)
        self.max_model_len = engine.max_model_len
        self.prep = Preparer(self.model_root, self.model_name, engine.vocab_size, self.max_model_len, config)
        self.tokenizer = self.prep.tokenizer  # the loop thread's
        self.metrics = ServerMetrics()
        self.engine = AsyncEngine(engine, {self.model_name}, self.metrics)
        self.lora_root = Path(config.lora_root).expanduser().resolve() if config.lora_root else None
        for name, path in config.lora_modules:
            try:
                check_adapter_name(name, self.model_name)
            except APIError as e:
                raise ConfigError(f"--lora-modules {name}={path}: {e.message}") from None
            self.engine.load_adapter_now(name, str(Path(path).expanduser().resolve()))

    async def _submit(self, model: str | None, job: Prepared, prefix: str) -> RequestStream:
        base = uuid.uuid4().hex
        reqs = [
            GenRequest(f"{prefix}-{base}-{i}", p.text, p.ids, sp)
            for i, (p, sp) in enumerate(zip(job.prompts, job.params))
        ]
        stream = await self.engine.add(reqs, model)
        self.metrics.adapter_requests[model or self.model_name] += 1
        return stream

    @staticmethod
    def _holdback(params: SamplingParams) -> int:
        return max((len(s) for s in params.stop_list), default=1) - 1

    # ---- /v1/completions ------------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        job = await self.prep.completion(await raw.body(), raw.headers.get("content-type"))
        req, prompts = job.req, job.prompts
        stream = await self._submit(req.model, job, "cmpl")
        model = req.model or self.model_name
        if req.stream:
            return SSEResponse(self._completion_events(req, model, stream, prompts, job.params[0]), stream)
        outs = await collect(stream, raw)
        if outs is None:
            return Response(status_code=499)
        lp = req.logprobs
        choices = []
        for i, p in enumerate(prompts):
            for c in outs[i].outputs:
                text, logprobs, offset = c.text, None, 0
                pairs = list(zip(c.token_ids, c.logprobs)) if lp is not None else []
                if req.echo:
                    text = p.echo + text
                    if lp is not None:
                        pairs = list(zip(p.ids, outs[i].prompt_logprobs)) + pairs
                if lp is not None:
                    logprobs, offset = legacy_logprobs(pairs, offset, self.tokenizer.decode)
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
            model=model, choices=choices, usage=usage([len(p.ids) for p in prompts], outs)
        )
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _completion_events(
        self,
        req: CompletionRequest,
        model: str,
        stream: RequestStream,
        prompts: list[Prompt],
        params: SamplingParams,
    ):
        rid, created, lp = random_id("cmpl"), int(time.time()), req.logprobs
        states: dict[int, Delta] = {}
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
                        st = states[idx] = Delta(self._holdback(params))
                    if st.done:
                        continue
                    text, new_ids, new_lps = st.advance(c)
                    pairs = list(zip(new_ids, new_lps)) if lp is not None else []
                    if first and req.echo:
                        text = prompts[i].echo + text
                        if lp is not None:
                            pairs = list(zip(prompts[i].ids, out.prompt_logprobs)) + pairs
                    logprobs = None
                    if lp is not None:
                        logprobs, offsets[idx] = legacy_logprobs(
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
                    yield sse(CompletionStreamResponse(id=rid, created=created, model=model, choices=choices))
            if req.stream_options is not None and req.stream_options.include_usage:
                used = usage([len(p.ids) for p in prompts], last)
                yield sse(
                    CompletionStreamResponse(id=rid, created=created, model=model, choices=[], usage=used)
                )
        except Exception as e:
            yield _error_event(e)
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions -------------------------------------------------------------------
    async def chat(self, raw: Request) -> Response:
        job = await self.prep.chat(await raw.body(), raw.headers.get("content-type"))
        req, prompt, params = job.req, job.prompts[0], job.params[0]
        stream = await self._submit(req.model, job, "chatcmpl")
        model = req.model or self.model_name
        if req.stream:
            return SSEResponse(self._chat_events(req, model, stream, prompt, params), stream)
        outs = await collect(stream, raw)
        if outs is None:
            return Response(status_code=499)
        top = req.top_logprobs or 0
        choices = [
            ChatCompletionChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=chat_logprobs(c.token_ids, c.logprobs, top) if req.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in outs[0].outputs
        ]
        resp = ChatCompletionResponse(model=model, choices=choices, usage=usage([len(prompt.ids)], outs))
        return Response(resp.model_dump_json(), media_type="application/json")

    async def _chat_events(
        self,
        req: ChatCompletionRequest,
        model: str,
        stream: RequestStream,
        prompt: Prompt,
        params: SamplingParams,
    ):
        rid, created = random_id("chatcmpl"), int(time.time())

        def chunk(choices, usage=None) -> str:
            return sse(
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
        states = {i: Delta(self._holdback(params)) for i in range(req.n)}
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
                        chat_logprobs(new_ids, new_lps, req.top_logprobs or 0)
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
                yield chunk([], usage([len(prompt.ids)], last))
        except Exception as e:
            yield _error_event(e)
        yield "data: [DONE]\n\n"

    # ---- models and adapters --------------------------------------------------------------------
    def models(self) -> ModelList:
        cards = [ModelCard(id=self.model_name, root=self.model_root, max_model_len=self.max_model_len)]
        for name, lr in sorted(self.engine.adapters.snapshot().items()):
            cards.append(ModelCard(id=name, root=lr.lora_path, parent=self.model_name))
        return ModelList(data=cards)

    def _check_runtime_updates(self) -> None:
        if not self.config.allow_runtime_lora_updating:
            raise APIError(
                403,
                "runtime LoRA loading is disabled on this server; restart it with "
                "--allow-runtime-lora-updating --lora-root DIR",
            )

    async def load_adapter(self, raw: Request) -> JSONResponse:
        self._check_runtime_updates()
        body = parse_body(await raw.body(), raw.headers.get("content-type"), LoadLoRAAdapterRequest)
        check_adapter_name(body.lora_name, self.model_name)
        path = resolve_lora_path(body.lora_path, self.lora_root)
        lr = await self.engine.load_adapter(body.lora_name, path, str(self.lora_root))
        return JSONResponse(
            {
                "message": f"Success: LoRA adapter '{lr.lora_name}' added successfully.",
                "lora_name": lr.lora_name,
                "lora_int_id": lr.lora_int_id,
                "lora_path": lr.lora_path,
            }
        )

    async def unload_adapter(self, raw: Request) -> JSONResponse:
        self._check_runtime_updates()
        body = parse_body(await raw.body(), raw.headers.get("content-type"), UnloadLoRAAdapterRequest)
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


def _document_bodies(app: FastAPI, bodies: dict[str, type]) -> None:
    """Show each route's request schema in /docs: the routes parse their raw body themselves
    (``parse_body``), so FastAPI cannot see it."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = default()
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                body = {"required": True, "content": {"application/json": {"schema": ref}}}
                spec["paths"][path]["post"]["requestBody"] = body
        return app.openapi_schema

    app.openapi = openapi


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
            server.prep.close()
            server.engine.shutdown()

    app = FastAPI(title="loraserve", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param)

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
    async def completions(raw: Request):
        return await guarded(server.completions(raw))

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await guarded(server.chat(raw))

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        return await guarded(server.load_adapter(raw))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        return await guarded(server.unload_adapter(raw))

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return error_response(503, f"the engine is not running: {server.engine.dead!r}")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return await guarded(server.render_metrics())

    _document_bodies(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
            "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
        },
    )
    app.add_middleware(
        Guard, api_key=config.api_key, metrics=server.metrics, max_request_bytes=config.max_request_bytes
    )
    return app
