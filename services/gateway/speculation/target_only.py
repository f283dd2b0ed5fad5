"""Target-only decoding: no drafter, n_max 0, or a drafter that failed or cannot pay."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from services.gateway.speculation.context import Context, cancel_calls
from tandem.v1 import tandem_pb2 as pb


class TargetOnly:
    """Verify calls without drafts, `plain_pipeline` of them in flight, each asking for several tokens.

    Each call's position is known in advance, so the next call already waits at the target when a step ends and its
    step starts at once, instead of a round trip later. A call asks for as many tokens as the target computes in
    `plain_burst_ms` (docs/decisions/0008). A call past the end (end of generation, a stop sequence, a client gone)
    computes tokens nobody reads; it is cancelled and the session is closed right after. A call that comes back short
    (its steps after the first failed) leaves the calls behind it at the wrong position: they are cancelled and the
    next call, sent from where the session is, meets the error.
    """

    name = "target-only"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def round(self) -> AsyncIterator[pb.Token]:
        """Every token to the end of the generation."""
        ctx = self.ctx
        inflight: deque[tuple[asyncio.Future, int]] = deque()
        ctx.plain_done = None
        planned = 0  # tokens the calls in flight ask for
        try:
            while True:
                while len(inflight) < ctx.opts.plain_pipeline and ctx.pos.produced + planned < ctx.req.max_tokens:
                    n = ctx.plain_steps(ctx.req.max_tokens - ctx.pos.produced - planned)
                    position = ctx.pos.target + planned
                    call = ctx.verify([], [], ctx.span, position=position, timed=False, steps=n)
                    inflight.append((asyncio.ensure_future(call), n))
                    planned += n
                if not inflight:
                    return
                call, n = inflight.popleft()
                planned -= n
                expected = ctx.pos.target + n
                result = await ctx.await_plain(call, time.perf_counter_ns())
                for token in result.tokens:
                    yield token
                if result.position != expected:
                    await cancel_calls([c for c, _ in inflight])
                    inflight.clear()
                    planned = 0
        finally:
            await cancel_calls([c for c, _ in inflight])
