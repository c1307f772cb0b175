"""HTTP errors in OpenAI's body ``{"error": {"message", "type", "code", "param"}}``, and the map from
engine / adapter / sampling exceptions to statuses (a bad request is a 4xx naming the field)."""

from __future__ import annotations

import logging

from starlette.responses import JSONResponse

from loraserve.engine.engine import RequestError
from loraserve.lora.errors import LoRAError, UnknownAdapterError
from loraserve.sampling import SamplingParamsError
from loraserve.server.async_engine import (
    EngineDeadError,
    RequestFailedError,
    ShuttingDownError,
    UnknownModelError,
)
from loraserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestTooLargeError",
        415: "UnsupportedMediaTypeError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The body; a lone surrogate echoed from a request into ``message`` is escaped (JSON must be UTF-8)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if param is not None:
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
    return ErrorResponse(
        error=ErrorInfo(
            message=message, type=APIError.TYPES.get(status, "APIError"), code=status, param=param
        )
    )


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param).model_dump(), status_code=status)


def as_api_error(e: BaseException) -> APIError:
    """Map engine / adapter / sampling errors to HTTP statuses; anything unexpected is a logged 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (UnknownModelError, UnknownAdapterError)):
        return APIError(404, str(e))
    if isinstance(e, SamplingParamsError):
        return APIError(400, str(e), e.param)
    if isinstance(e, (RequestError, LoRAError)):
        return APIError(400, str(e))
    if isinstance(e, (EngineDeadError, ShuttingDownError)):
        return APIError(503, str(e))
    if isinstance(e, RequestFailedError):  # the engine logged it; the message names the cause
        return APIError(500, str(e))
    logger.exception("unexpected error", exc_info=e)
    return APIError(500, f"internal error: {e!r}")
