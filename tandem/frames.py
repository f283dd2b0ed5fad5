"""The frame transport: Verify and Propose as length-prefixed protobuf messages over one plain (or TLS) socket.

Every speculative round between processes makes one or two of these calls, and in Python gRPC carries each message
through several threads (the asyncio loop, gRPC's poller, its completion queue) on both sides: measured on loopback,
an echo costs ~280 us idle and ~560 us when the caller sleeps 10 ms between calls (a round's compute), against ~175 and
~285 us for the same echo over an asyncio socket (docs/decisions/0017-frame-transport.md). Frames keep the contract
(the same messages, request ids, in-band error statuses and trace context as VerifyStream / ProposeStream) and drop
the hand-offs: a message is parsed in the event loop's socket callback and answered from the handler's task.

Wire format, both directions: a header of payload length (u32 little-endian) and kind (u8), then the payload. The
caller opens with HELLO (`MAGIC`, a newline, the shared token or nothing); the service answers HELLO, or ERROR with a
message and closes. Then every frame is a call (VERIFY, PROPOSE: the request message) or its answer (same kind:
the response message, matched by request_id). gRPC stays for everything else (Info, Open, Close, health).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"tandem-frames/1"
HELLO, ERROR, VERIFY, PROPOSE = 1, 2, 3, 4
HEADER = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 * 1024 * 1024  # as gRPC's message limit (tandem.grpc_server.MAX_MESSAGE_BYTES)


class FrameError(ConnectionError):
    """The peer broke the framing (an unknown kind, an oversize frame) or refused the hello."""


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


class FrameReader:
    """Splits a byte stream into (kind, payload) frames as bytes arrive."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            length, kind = HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((kind, bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return frames


@dataclass(frozen=True)
class FrameMethod:
    """A call the service answers on frames: its request type and the unary handler that answers it."""

    request_type: type
    response_type: type
    handler: Callable[[Any, Any], Awaitable[Any]]
    name: str  # the gRPC method name, for spans and logs


class _ServerConnection(asyncio.Protocol):
    """One caller's connection: hello first, then each call answered by its own task (calls from many requests must
    reach the step scheduler together to be batched, as on a stream)."""

    def __init__(self, methods: dict[int, FrameMethod], token: bytes | None, answer: Callable) -> None:
        self._methods = methods
        self._token = token
        self._answer = answer
        self._reader = FrameReader()
        self._greeted = False
        self._transport: asyncio.Transport | None = None
        self._tasks: set[asyncio.Task] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            for kind, payload in self._reader.feed(data):
                if not self._greeted:
                    self._hello(kind, payload)
                elif (method := self._methods.get(kind)) is not None:
                    task = asyncio.create_task(self._call(kind, method, method.request_type.FromString(payload)))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    raise FrameError(f"unknown frame kind {kind}")
        except Exception as exc:  # a malformed frame or message: say why, then hang up (no call is half-read)
            self._refuse(f"{type(exc).__name__}: {exc}")

    def _hello(self, kind: int, payload: bytes) -> None:
        magic, _, token = payload.partition(b"\n")
        if kind != HELLO or magic != MAGIC:
            raise FrameError(f"expected a {MAGIC.decode()} hello")
        if self._token is not None and not hmac.compare_digest(token, self._token):
            raise FrameError("missing or wrong token")
        self._greeted = True
        self._transport.write(frame(HELLO, MAGIC))

    def _refuse(self, message: str) -> None:
        log.warning("frame connection refused: %s", message)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(ERROR, message.encode()))
            self._transport.close()

    async def _call(self, kind: int, method: FrameMethod, request: Any) -> None:
        response = await self._answer(method, request)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame(kind, response.SerializeToString()))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None  # calls in flight finish (the sessions' state stays consistent); answers are dropped


def server_ssl_context(cert: Path | None, key: Path | None, client_ca: Path | None) -> ssl.SSLContext | None:
    """The TLS (mutual with a client CA) context of the gRPC port, for the frame port; None for plaintext."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """What the gateway's gRPC channel verifies (the CA) and presents (a client certificate), for frames."""
    if ca is None:
        return None
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    return context


async def start_frame_server(
    host: str,
    port: int,
    methods: dict[int, FrameMethod],
    answer: Callable[[FrameMethod, Any], Awaitable[Any]],
    ssl_context: ssl.SSLContext | None = None,
    token: str | None = None,
) -> asyncio.Server:
    """Listen for frame connections; `answer(method, request)` returns the response (errors in-band, never raises)."""
    expected = token.encode() if token else None
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: _ServerConnection(methods, expected, answer), host, port, ssl=ssl_context, reuse_address=True
    )
