"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right HTTP status.

One table maps every failure the gateway can meet (bad JSON, validation, upstream gRPC status codes) to a status,
so no handler invents its own and nothing falls through to an unshaped 500.
"""

from __future__ import annotations

import json
import logging

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# Upstream gRPC status -> (HTTP status, OpenAI code).
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_value"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_value"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "resource_exhausted"),
    grpc.StatusCode.UNAVAILABLE: (503, "upstream_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "upstream_timeout"),
    grpc.StatusCode.CANCELLED: (503, "upstream_cancelled"),
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, path: str = "") -> JSONResponse:
        """OpenAI's error shape, or Anthropic's on the /v1/messages routes."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        body = anthropic_error_body(self) if path.startswith(ANTHROPIC_PATHS) else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(exc: OpenAIError) -> dict:
    """Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def from_grpc(exc: grpc.aio.AioRpcError) -> OpenAIError:
    status, code = _GRPC_TO_HTTP.get(exc.code(), (502, "upstream_error"))
    detail = exc.details() or exc.code().name
    if status == 400 and "context" in detail:
        code = "context_length_exceeded"
    return OpenAIError(status, f"upstream: {detail}", None, code)


def as_openai_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_grpc(exc)
    log.exception("unexpected error", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}")


def from_validation(exc: ValidationError) -> OpenAIError:
    """A 400 from a pydantic error raised while translating one API's request into another's."""
    first = exc.errors()[0] if exc.errors() else {}
    ctx_error = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_error, OpenAIError):
        return ctx_error
    param = _param_of(tuple(first.get("loc", ())))
    message = first.get("msg", "invalid request")
    return OpenAIError(400, f"{param}: {message}" if param else message, param, "invalid_value")


def _param_of(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        path = request.url.path
        if first.get("type") == "json_invalid":
            return OpenAIError(400, "request body is not valid JSON", None, "invalid_json").response(path)
        # A validator may have raised our own error (unsupported parameter): keep its message and param.
        ctx_error = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_error, OpenAIError):
            return ctx_error.response(path)
        param = _param_of(tuple(first.get("loc", ())))
        message = first.get("msg", "invalid request")
        if param:
            message = f"{param}: {message}"
        return OpenAIError(400, message, param, "invalid_value").response(path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail)).response(request.url.path)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def _grpc(request: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        return from_grpc(exc).response(request.url.path)

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception) -> JSONResponse:
        return as_openai_error(exc).response(request.url.path)


def sse_error(exc: BaseException) -> str:
    return f"data: {json.dumps(as_openai_error(exc).body())}\n\n"
