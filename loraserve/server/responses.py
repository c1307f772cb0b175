"""Building OpenAI response bodies and SSE streams from engine outputs: logprobs formats, usage,
streaming deltas, and collecting a request's final outputs (aborting it if the client leaves)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import StreamingResponse

from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.server.async_engine import RequestStream
from loraserve.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
    UsageInfo,
)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


class SSEResponse(StreamingResponse):
    """Aborts the engine requests when the stream ends for any reason (client gone included)."""

    def __init__(self, content, stream: RequestStream):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._stream = stream

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()


def sse(chunk) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect(stream: RequestStream, request: Request) -> dict[int, RequestOutput] | None:
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


def legacy_logprobs(pairs, offset: int, decode) -> tuple[CompletionLogProbs, int]:
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


def chat_logprobs(token_ids: list[int], dicts, top_k: int) -> ChatLogprobs:
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


def usage(prompt_lens: list[int], outs: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outs.values() for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Delta:
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
