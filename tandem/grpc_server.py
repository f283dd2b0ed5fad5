"""gRPC scaffolding shared by the model services: server start-up, health, reflection, error mapping.

The server listens before the model loads, so orchestrators can see NOT_SERVING (grpc.health.v1) while a large
GGUF loads; RPCs that need the model answer UNAVAILABLE until then. Errors are mapped to status codes in one
interceptor, never in the servicers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import propagate
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

from tandem.errors import TandemError
from tandem.frames import FrameMethod, server_ssl_context, start_frame_server
from tandem.telemetry import context_from_metadata, tracer, tracing_on

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class ServiceLoading(TandemError):
    code = grpc.StatusCode.UNAVAILABLE


def error_status(exc: Exception, method: str, span) -> tuple[grpc.StatusCode, str]:
    """The status a failed call answers with: a TandemError's own code, anything else INTERNAL with a logged trace.

    The one mapping for unary calls (ErrorInterceptor), stream calls (stream_replies) and in-process calls
    (services.gateway.colocated); call it from the `except` block, so the trace is the failure's.
    """
    if isinstance(exc, TandemError):
        span.set_attribute("rpc.grpc.status_code", exc.code.value[0])
        return exc.code, str(exc)
    log.exception("unhandled error in %s", method)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turn typed TandemErrors into their status codes, and anything else into INTERNAL with a logged trace."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            parent = context_from_metadata(context.invocation_metadata())
            with tracer().start_as_current_span(method, context=parent, kind=SpanKind.SERVER) as span:
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await context.abort(*error_status(exc, method, span))

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def server_span(request: Any, span_name: str) -> AbstractContextManager[Span]:
    """A stream or frame call's server span; none where there is nothing to record (no trace context sent and no
    tracer provider here), which spares every call the context extraction and a no-op span (see
    docs/decisions/0003-grpc-streams-and-io.md)."""
    if not request.trace_context and not tracing_on():
        return nullcontext(INVALID_SPAN)
    parent = propagate.extract(dict(request.trace_context))
    return tracer().start_as_current_span(span_name, context=parent, kind=SpanKind.SERVER)


async def answer_call(
    handler: Callable[[Any, Any], Awaitable[Any]], request: Any, response_type: type, context: Any, span_name: str
) -> Any:
    """Answer one call of a stream or a frame connection: the handler's response, or its failure as an in-band `error`
    status (the stream or connection serves other calls and must not end), with the request's id."""
    from tandem.v1 import tandem_pb2 as pb

    with server_span(request, span_name) as span:
        try:
            response = await handler(request, context)
        except Exception as exc:
            code, message = error_status(exc, span_name, span)
            response = response_type(error=pb.Status(code=code.value[0], message=message))
    response.request_id = request.request_id
    return response


async def stream_replies(
    requests: AsyncIterator[Any],
    handler: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
    response_type: type,
    context: grpc.aio.ServicerContext,
    span_name: str,
) -> AsyncIterator[Any]:
    """Serve a request stream with a unary handler; failures become in-band `error` statuses.

    Requests are handled concurrently, each answer sent when ready and matched by request_id: one stream carries
    the calls of every request the gateway is serving, and they must reach the step scheduler together to be
    batched. (A caller that needs order waits for its answer before sending its next call, as the gateway does.)
    """
    answers: asyncio.Queue = asyncio.Queue()
    done = object()

    async def answer(request: Any) -> None:
        await answers.put(await answer_call(handler, request, response_type, context, span_name))

    async def read() -> None:
        tasks: set[asyncio.Task] = set()
        try:
            async for request in requests:
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await answers.put(done)

    reader = asyncio.create_task(read())
    try:
        while (item := await answers.get()) is not done:
            yield item
    finally:
        reader.cancel()


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without the shared token (health checks stay open for orchestrators' probes)."""

    OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        if handler_call_details.method.startswith(self.OPEN_PREFIXES):
            return await continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return await continuation(handler_call_details)

        async def refuse(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        handler = await continuation(handler_call_details)
        if handler is not None and handler.stream_stream is not None:

            async def refuse_stream(requests, context: grpc.aio.ServicerContext):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
                yield  # pragma: no cover - makes this an async generator

            return grpc.stream_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_unary_rpc_method_handler(refuse)


def server_credentials(cert: Path | None, key: Path | None, client_ca: Path | None) -> grpc.ServerCredentials | None:
    """TLS (and, with a client CA, mutual TLS) server credentials, or None for plaintext."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials(
        [(key.read_bytes(), cert.read_bytes())],
        root_certificates=client_ca.read_bytes() if client_ca else None,
        require_client_auth=client_ca is not None,
    )


async def serve(
    *,
    host: str,
    port: int,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Awaitable[None]],
    periodic: Callable[[], Awaitable[None]] | None = None,
    period_s: float = 5.0,
    credentials: grpc.ServerCredentials | None = None,
    auth_token: str | None = None,
    frames: FrameOffer | None = None,
) -> None:
    """Listen on host:port, report NOT_SERVING, run `load`, report SERVING, then serve until SIGINT/SIGTERM.

    With `frames`, Verify or Propose is also served on the frame transport (tandem/frames.py), on its own port.
    """
    interceptors = [TokenInterceptor(auth_token)] if auth_token else []
    server = grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()], options=SERVER_OPTIONS)
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not listen on {host}:{port}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # Printed (and flushed) so launchers that asked for port 0 learn the real port.
    print(f"tandem: {service_name} listening on {host}:{bound}", flush=True)
    frame_server = await frames.start(host, auth_token) if frames is not None else None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def load_then_serve() -> None:
        try:
            await load()
        except Exception:
            log.exception("model failed to load")
            stop.set()
            raise
        for name in ("", service_name):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        print(f"tandem: {service_name} ready on {host}:{bound}", flush=True)

    async def tick() -> None:
        while periodic is not None:
            await asyncio.sleep(period_s)
            try:
                await periodic()
            except Exception:
                log.exception("periodic task failed")

    loader = asyncio.create_task(load_then_serve())
    ticker = asyncio.create_task(tick())
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    ticker.cancel()
    if frame_server is not None:
        frame_server.close()
    await server.stop(grace=2.0)
    if loader.done() and loader.exception() is not None:
        raise SystemExit(1)
    loader.cancel()


def frame_offer(settings, methods: dict[int, FrameMethod]) -> FrameOffer | None:
    """The frame transport of a model service's settings: its port, the gRPC port's TLS; None with --frame-port -1."""
    if settings.frame_port < 0:
        return None
    return FrameOffer(
        methods, settings.frame_port, server_ssl_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    )


@dataclass
class FrameOffer:
    """What a service answers on the frame transport, where it listens (0: any free port), and, once listening, the
    port it tells callers in Info (`bound`; 0 while not listening)."""

    methods: dict[int, FrameMethod]
    port: int = 0
    ssl_context: ssl.SSLContext | None = None
    bound: int = 0

    async def start(self, host: str, token: str | None) -> asyncio.Server:
        async def answer(method: FrameMethod, request: Any) -> Any:
            return await answer_call(method.handler, request, method.response_type, None, method.name)

        server = await start_frame_server(host, self.port, self.methods, answer, self.ssl_context, token)
        self.bound = server.sockets[0].getsockname()[1]
        print(f"tandem: frames on {host}:{self.bound}", flush=True)
        return server


async def serve_service(
    settings,
    *,
    service_name: str,
    register: Callable[[grpc.aio.Server], None],
    load: Callable[[], Awaitable[None]],
    periodic: Callable[[], Awaitable[None]] | None,
    frames: FrameOffer | None = None,
) -> None:
    """`serve` with the address, TLS and token of a model service's settings (and `frame_offer`'s frames)."""
    await serve(
        host=settings.host,
        port=settings.port,
        service_name=service_name,
        register=register,
        load=load,
        periodic=periodic,
        credentials=server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
        auth_token=settings.auth_token,
        frames=frames,
    )
