"""Typed errors raised by the core and mapped to gRPC status codes in one place (grpc_server.ErrorInterceptor).

The engine and session code never import grpc; they raise these, and the interceptor turns each into the status
code a client can act on (retry, re-open, give up).
"""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """Base class: carries the gRPC status code that describes the failure."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(TandemError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class SessionNotFound(TandemError):
    code = grpc.StatusCode.NOT_FOUND


class PositionMismatch(TandemError):
    """The caller's idea of the session's position differs from the service's: state was not touched."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ConditionNotMet(TandemError):
    """A conditional call's condition did not hold (Continuation.stop_at_repeat): nothing changed."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(TandemError):
    """No free session slot or KV cells: retry later or with a shorter prompt."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ContextOverflow(ResourceExhausted):
    """The sequence would not fit the session's context window."""


class EngineFailure(TandemError):
    code = grpc.StatusCode.INTERNAL


class PromptTooLong(TandemError):
    """A draft of another vocabulary cannot hold this prompt (its context is shorter than the target's): the caller
    decodes target-only. OUT_OF_RANGE, so that it is told apart from a full service."""

    code = grpc.StatusCode.OUT_OF_RANGE
