"""What stands between the network and the models: API keys, request size, and bounded concurrency with a queue.

Everything refused here is refused with an OpenAI-shaped error before any model work starts: 401 for a missing or
wrong key, 413 for an oversized body, 429 with Retry-After when the queue is full.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from services.gateway.errors import OpenAIError

OPEN_PATHS = ("/health",)


def check_api_key(authorization: str | None, keys: list[str], x_api_key: str | None = None) -> None:
    """Constant-time comparison against every configured key (no early exit that would leak which one matched).
    `Authorization: Bearer <key>` or, as Anthropic's clients send it, `x-api-key: <key>`."""
    if not keys:
        return
    scheme, _, token = (authorization or "").partition(" ")
    presented = token.strip().encode() if scheme.lower() == "bearer" else (x_api_key or "").strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    if not presented or not matched:
        raise OpenAIError(
            401, "missing or invalid API key (send 'Authorization: Bearer <key>')", None, "invalid_api_key"
        )


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413, by Content-Length or while streaming in."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = OpenAIError(413, f"request body larger than {self.limit} bytes", None, "request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await too_big.response()(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_big
            return message

        await self.app(scope, limited_receive, send)


class Admission:
    """At most `concurrent` generations at once; up to `queue` more wait; anyone beyond that gets a 429 now."""

    def __init__(self, concurrent: int, queue: int) -> None:
        self._slots = asyncio.Semaphore(concurrent)
        self.concurrent = concurrent
        self.queue = queue
        self.waiting = 0
        self.running = 0

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._slots.locked() and self.waiting >= self.queue:
            raise OpenAIError(
                429, f"server busy: {self.running} requests running and {self.waiting} queued; retry shortly",
                None, "rate_limit_exceeded",
            )  # fmt: skip
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()
