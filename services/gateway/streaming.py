"""SSE responses that stop generating the moment the client goes away.

Starlette's StreamingResponse, under ASGI 2.4 servers (uvicorn), notices a disconnect only at its next write; with
a slow round (a model draft, a long verify) the sessions would stay busy for that long. This one also listens for
`http.disconnect` and cancels the body at once, then closes the body's generator, so the generation's cleanup closes
both sessions immediately.
"""

from __future__ import annotations

import contextlib
import logging

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


class DisconnectAwareStreamingResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def body() -> None:
                try:
                    with contextlib.suppress(OSError):  # the client went away between two writes
                        await self.stream_response(send)
                finally:
                    # A cancellation that lands on a write (outside the generator) leaves the generator suspended
                    # until the garbage collector finds it, its sessions open; close it now, whatever was awaited.
                    close = getattr(self.body_iterator, "aclose", None)
                    if close is not None:
                        with anyio.CancelScope(shield=True):
                            try:
                                await close()
                            except Exception:  # its cleanup failed: log it, and still end the response
                                log.warning("closing a cancelled stream failed", exc_info=True)
                group.cancel_scope.cancel()

            async def watch() -> None:
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(body)
            await watch()
        if self.background is not None:
            await self.background()
