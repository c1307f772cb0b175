"""``Guard``: the pure-ASGI layer in front of every route: API key, request-body cap, request counts.

NOTE: pure ASGI, not a BaseHTTPMiddleware, which would get in the way of streaming and disconnects.
"""

from __future__ import annotations

import secrets

from loraserve.server.errors import APIError, error_response
from loraserve.server.metrics import ServerMetrics

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/metrics",
)


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than {limit} bytes (the server's --max-request-bytes); send less"
    )


class Guard:
    """Checks the API key on /v1 routes (401), then caps the request body at ``max_request_bytes``
    before anything parses it: a Content-Length over the cap is a 413 at once; a body sent without
    one is counted as it arrives, and reading past the cap raises a 413 ``APIError`` in the reader."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, max_request_bytes: int):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics
        self.max_bytes = max_request_bytes

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
            headers = dict(scope["headers"])
            if self.key is not None and path.startswith("/v1"):
                if not secrets.compare_digest(headers.get(b"authorization", b""), self.key):
                    msg = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                    return await error_response(401, msg)(scope, receive, send_and_count)
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                err = body_too_large(self.max_bytes)
                return await error_response(err.status, err.message)(scope, receive, send_and_count)
            await self.app(scope, self._capped(receive), send_and_count)
        finally:
            self.metrics.requests[(endpoint, status)] += 1

    def _capped(self, receive):
        received = 0

        async def capped_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise body_too_large(self.max_bytes)
            return msg

        return capped_receive
