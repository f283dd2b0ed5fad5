"""Many calls over one long-lived bidirectional gRPC stream (Target.VerifyStream, Draft.ProposeStream).

On the loopback of a small machine a unary gRPC call costs ~0.7 ms and a message on an open stream ~0.4 ms; with a
forward pass of a few milliseconds that difference is a large share of each speculative round. Calls from all
requests share one stream per service; each carries a request_id and the matching answer resolves its future.
A broken stream fails the calls in flight with UNAVAILABLE and is reopened by the next call, so a restarted
service is picked up without restarting the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tandem.frames import ERROR, HELLO, MAGIC, FrameError, FrameReader, frame

log = logging.getLogger(__name__)


def upstream_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The same exception type a unary call raises, so callers handle both paths alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _expire(future: asyncio.Future, name: str, timeout: float) -> None:
    if not future.done():
        future.set_exception(upstream_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: no answer in {timeout} s"))


class _Stream:
    """One open bidi call, the calls waiting for an answer on it, and its writer's queue."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.pending: dict[int, asyncio.Future] = {}
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.reader: asyncio.Task | None = None
        self.writer: asyncio.Task | None = None

    def fail(self, name: str, reason: str) -> None:
        pending, self.pending = self.pending, {}
        _fail_pending(pending, name, reason)


def _fail_pending(pending: dict[int, asyncio.Future], name: str, reason: object) -> None:
    """Fail the calls waiting on a broken stream or connection with UNAVAILABLE (the next call opens a new one)."""
    for future in pending.values():
        if not future.done():
            future.set_exception(upstream_error(grpc.StatusCode.UNAVAILABLE, f"{name}: {reason}"))


def _checked(response: Any) -> Any:
    """The response, or its in-band error status raised as the error a unary call would raise."""
    if response.HasField("error"):
        code = _CODES.get(response.error.code, grpc.StatusCode.UNKNOWN)
        raise upstream_error(code, response.error.message)
    return response


class StreamMux:
    def __init__(self, open_stream: Callable[[], Any], name: str) -> None:
        self._open_stream = open_stream
        self.name = name
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    async def call(self, request: Any, timeout: float) -> Any:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        request_id = next(self._ids)
        request.request_id = request_id
        stream = self._stream
        if stream is None:
            stream = self._stream = _Stream(self._open_stream())
            stream.reader = asyncio.create_task(self._read(stream))
            stream.writer = asyncio.create_task(self._write(stream))
        stream.pending[request_id] = future
        stream.outbox.put_nowait(request)
        # A timer instead of asyncio.wait_for(asyncio.shield(...)): each wrapper cost the answer an extra trip through
        # the event loop (the mux's own cost per call went from 58-63 to 42-47 us here, measured), and a round makes
        # two calls.
        timer = asyncio.get_running_loop().call_later(timeout, _expire, future, self.name, timeout)
        try:
            response = await future
        finally:
            timer.cancel()
            # Timed out or cancelled (client gone): forget the call, so a late answer or a stream failure
            # has no one to report to (and a call not written yet is never sent).
            if stream.pending.get(request_id) is future:
                stream.pending.pop(request_id, None)
            if not future.done():
                future.cancel()
        return _checked(response)

    async def _write(self, stream: _Stream) -> None:
        """The only writer of the stream. In grpc aio a write whose task is cancelled cancels the whole RPC, which
        would fail every request sharing the stream; so callers never write themselves, and a caller that is gone
        (a client that disconnected, a pipelined call no longer needed) is simply not written."""
        try:
            while True:
                request = await stream.outbox.get()
                if request.request_id in stream.pending:
                    await stream.call.write(request)
        except asyncio.CancelledError:
            pass  # the stream was dropped or closed
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._drop(stream, f"write failed: {exc}")

    async def _read(self, stream: _Stream) -> None:
        reason = "stream ended"
        try:
            async for response in stream.call:
                future = stream.pending.pop(response.request_id, None)
                if future is not None and not future.done():
                    future.set_result(response)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "gateway shutting down"
        finally:
            self._drop(stream, reason)

    def _drop(self, stream: _Stream, reason: str) -> None:
        """Fail the calls waiting on `stream`; the next call opens a fresh one."""
        if self._stream is stream:
            self._stream = None
        if stream.writer is not None and stream.writer is not asyncio.current_task():
            stream.writer.cancel()
        stream.call.cancel()
        stream.fail(self.name, reason)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.call.cancel()
            for task in (stream.writer, stream.reader):
                if task is not None:
                    task.cancel()


class _FrameConnection(asyncio.Protocol):
    """The gateway's end of a frame connection: answers are matched to waiting calls in the socket callback."""

    def __init__(self, response_type: type, name: str) -> None:
        self.response_type = response_type
        self.name = name
        self.reader = FrameReader()
        self.pending: dict[int, asyncio.Future] = {}
        self.transport: asyncio.Transport | None = None
        self.greeted: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for kind, payload in self.reader.feed(data):
                if kind == HELLO:
                    self.greeted.done() or self.greeted.set_result(None)
                elif kind == ERROR:
                    raise FrameError(f"the service refused: {payload.decode(errors='replace')}")
                else:
                    response = self.response_type.FromString(payload)
                    future = self.pending.pop(response.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(response)
        except Exception as exc:
            self._fail(exc)
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(exc or ConnectionError("connection closed"))

    def _fail(self, exc: Exception) -> None:
        if not self.greeted.done():
            self.greeted.set_exception(exc if isinstance(exc, (FrameError, OSError)) else FrameError(str(exc)))
        pending, self.pending = self.pending, {}
        _fail_pending(pending, self.name, exc)


class FrameMux:
    """StreamMux's interface over the frame transport (tandem/frames.py), the gRPC stream as its fallback.

    Connects on the first call to the port the service names in Info, and after a lost connection asks again (a
    restarted service may listen elsewhere; one that is down fails the call with UNAVAILABLE, as a broken stream
    does). Where the service offers no frames or its port cannot be reached (a port mapping, a network policy), calls
    go over the gRPC stream and frames are tried again after RETRY_S.
    """

    RETRY_S = 60.0
    CONNECT_TIMEOUT_S = 5.0

    def __init__(
        self,
        host: str,
        kind: int,
        response_type: type,
        locate: Callable[[], Awaitable[int]],
        fallback: StreamMux,
        ssl_context: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        self.host = host
        self.kind = kind
        self.response_type = response_type
        self.name = fallback.name
        self._locate = locate
        self.fallback = fallback
        self._ssl = ssl_context
        self._hello = frame(HELLO, MAGIC + b"\n" + (token or "").encode())
        self._connection: _FrameConnection | None = None
        self._lock = asyncio.Lock()
        self._grpc_until = 0.0
        self._ids = itertools.count(1)

    @property
    def on_frames(self) -> bool:
        """Whether calls go over a frame connection now (else over the gRPC stream)."""
        return self._connection is not None and self._connection.open

    async def call(self, request: Any, timeout: float) -> Any:
        connection = self._connection
        if connection is None or not connection.open:
            connection = await self._connect()
            if connection is None:
                return await self.fallback.call(request, timeout)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        request_id = request.request_id = next(self._ids)
        connection.pending[request_id] = future
        connection.transport.write(frame(self.kind, request.SerializeToString()))
        timer = loop.call_later(timeout, _expire, future, self.name, timeout)
        try:
            response = await future
        finally:
            timer.cancel()
            connection.pending.pop(request_id, None)
            if not future.done():
                future.cancel()
        return _checked(response)

    async def _connect(self) -> _FrameConnection | None:
        async with self._lock:
            if self._connection is not None and self._connection.open:
                return self._connection
            if time.monotonic() < self._grpc_until:
                return None
            try:
                port = await self._locate()
            except grpc.aio.AioRpcError as exc:  # the service is down: fail as a broken stream does
                raise upstream_error(grpc.StatusCode.UNAVAILABLE, f"{self.name}: {exc.details()}") from exc
            if not port:
                self._grpc_until = time.monotonic() + self.RETRY_S
                return None
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.CONNECT_TIMEOUT_S):
                    _, connection = await loop.create_connection(
                        lambda: _FrameConnection(self.response_type, self.name),
                        self.host,
                        port,
                        ssl=self._ssl,
                        server_hostname=self.host if self._ssl else None,
                    )
                    connection.transport.write(self._hello)
                    await connection.greeted
            except (OSError, FrameError, TimeoutError) as exc:
                log.warning(
                    "%s: frames on %s:%d not usable (%s); calls go over the gRPC stream for %.0f s",
                    self.name, self.host, port, exc or type(exc).__name__, self.RETRY_S,
                )  # fmt: skip
                self._grpc_until = time.monotonic() + self.RETRY_S
                return None
            log.info("%s: calls over frames on %s:%d", self.name, self.host, port)
            self._connection = connection
            return connection

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.transport is not None:
            connection.transport.close()
        await self.fallback.close()
