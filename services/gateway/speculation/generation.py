"""One request's speculative decoding: open both sessions, run rounds of the chosen strategy, close.

A round, whatever the drafter:
  1. propose: the drafter proposes up to k tokens after the sequence so far;
  2. verify: the target evaluates [pending token, d1..dk] in one forward pass, accepts a prefix d1..dj by the
     lossless rule, adds its own token, and rolls its KV cache back past the first rejection;
  3. settle: the j + 1 tokens are emitted; the drafter learns them before its next proposal.
Every call names the position it expects, so a retried call is answered from memory instead of being applied twice.

The strategies (one per way of drafting) differ in where drafts come from and in what they overlap or skip:
TargetOnly, ModelDraft, NgramService and LocalLookup. If the drafter fails (dies, times out, answers out of order)
the request goes on target-only: the target's state alone defines the output, so no token is lost, repeated or
altered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from services.gateway.costs import CostModel
from services.gateway.metrics import GatewayMetrics
from services.gateway.speculation.context import Context
from services.gateway.speculation.cross_vocab import CrossVocabDraft
from services.gateway.speculation.local_lookup import LocalLookup
from services.gateway.speculation.model_draft import ModelDraft
from services.gateway.speculation.ngram_service import NgramService
from services.gateway.speculation.state import GenerationOptions, GenerationRequest, GenerationStats
from services.gateway.speculation.target_only import TargetOnly
from services.gateway.upstream import Upstreams
from tandem.convert import constraint_to_pb
from tandem.telemetry import metadata_for, tracer
from tandem.v1 import tandem_pb2 as pb

log = logging.getLogger(__name__)
# A model draft this many emitted tokens behind (it opened after the target decoded them) catches up beside the
# target's calls; fewer go with the next round's Propose.
BACKGROUND_CATCH_UP = 8
# After the target's first token, the draft's Open is awaited this part of the target's prompt time (at least what
# one target-only call would take, `plain_burst_ms`: a prompt the target had cached takes it milliseconds, and an
# n-gram draft service answers its Open in about as long), then no longer.
DRAFT_OPEN_GRACE = 0.5

Strategy = TargetOnly | ModelDraft | NgramService | LocalLookup | CrossVocabDraft


def choose_strategy(ctx: Context) -> Strategy:
    """The strategy for this request's drafter; target-only where there is none or n_max is 0."""
    if not ctx.drafting:
        return TargetOnly(ctx)
    if ctx.opts.local_ngram:
        return LocalLookup(ctx)
    if ctx.up.draft_is_ngram:
        return NgramService(ctx)
    if ctx.up.draft_cross_vocabulary:
        return CrossVocabDraft(ctx)
    return ModelDraft(ctx)


class Generation:
    """One request's speculative decoding; iterate `tokens()`, read `stats` at any time."""

    def __init__(
        self,
        upstreams: Upstreams,
        request: GenerationRequest,
        options: GenerationOptions | None = None,
        metrics: GatewayMetrics | None = None,
        costs: CostModel | None = None,
        running: Callable[[], int] | None = None,
    ) -> None:
        """`running`: how many generations the gateway runs now (this one included), for `draft_max_running`."""
        self.req = request
        self._running = running
        self.options = options or GenerationOptions()
        self.ctx = Context(upstreams, request, self.options, metrics, costs if costs is not None else CostModel())
        has_drafter = upstreams.draft is not None or self.options.local_ngram
        self.ctx.drafting = has_drafter and request.n_max > 0
        self.strategy: Strategy = choose_strategy(self.ctx)
        self._waited_for_draft = False  # the grace for the draft's Open (`_draft_pending`) is given once
        self._joining = False  # decoded without the draft: it catches up beside the target's calls before drafting

    @property
    def stats(self) -> GenerationStats:
        return self.ctx.stats

    @property
    def session_id(self) -> str:
        return self.ctx.session_id

    @property
    def costs(self) -> CostModel:
        return self.ctx.costs

    async def tokens(self) -> AsyncIterator[pb.Token]:
        """Emitted tokens in order; close the iterator (contextlib.aclosing) to free both sessions early."""
        ctx = self.ctx
        t0 = time.perf_counter_ns()
        ctx.started_ns = ctx.last_token_ns = t0
        m = ctx.metrics
        if m:
            m.active_requests.inc()
        ctx.span = tracer().start_span(
            "tandem.generate",
            attributes={"tandem.prompt_tokens": len(self.req.prompt_token_ids), "tandem.n_max": self.req.n_max},
        )
        limit = self.options.draft_max_running
        if limit and ctx.drafting and self._running is not None and self._running() > limit:
            ctx.drafting = False  # a busy server: this request sheds speculation (decided once, at its start)
            self.strategy = TargetOnly(ctx)
            ctx.stats.load_shed = True
        try:
            opened = await self._open()
            ctx.started_ns = ctx.last_token_ns = time.perf_counter_ns()
            ctx.stats.prompt_ns = ctx.started_ns - t0
            if ctx.stats.speculation == "off":  # unless the draft's Open already ended drafting, saying why
                ctx.stats.speculation = "on" if ctx.drafting else "off"
            if m:
                m.ttft.observe(ctx.stats.prompt_ns / 1e9)
                m.prompt_tokens.inc(len(self.req.prompt_token_ids))
            ctx.pos.target = opened.position
            ctx.emit(opened.first_token)
            yield opened.first_token
            if opened.first_token.is_eog:
                return
            while ctx.pos.produced < self.req.max_tokens:
                if not ctx.drafting and not isinstance(self.strategy, TargetOnly):
                    self.strategy = TargetOnly(ctx)  # the drafter failed, or drafting cannot pay here
                # A draft slower to prefill than the target (a CPU draft for a GPU target, a long prompt) joins when
                # its Open answers; until then the target decodes alone rather than waiting for it.
                rounds = self._plain_while_draft_opens() if await self._draft_pending() else self.strategy.round()
                async with aclosing(rounds) as tokens:
                    async for token in tokens:
                        last = ctx.emit(token)
                        yield token
                        if last:
                            return
        finally:
            ctx.stats.predicted_ns = time.perf_counter_ns() - ctx.started_ns
            ctx.span.set_attributes(
                {
                    "tandem.predicted_n": ctx.stats.predicted_n,
                    "tandem.draft_n": ctx.stats.draft_n,
                    "tandem.draft_n_accepted": ctx.stats.draft_n_accepted,
                    "tandem.speculation": ctx.stats.speculation,
                }
            )
            ctx.span.end()
            if m:
                m.active_requests.dec()
                m.observe_generation(ctx.stats)
                if ctx.stats.predicted_ns > 0 and ctx.stats.predicted_n > 1:
                    m.decode_rate.observe(ctx.stats.predicted_n / (ctx.stats.predicted_ns / 1e9))
            await self._close()

    async def _draft_pending(self) -> bool:
        """Whether to decode without the draft for now: it is still opening, or catching up on the tokens decoded
        meanwhile. A model draft that opened behind many such tokens learns them in a Propose of its own, beside the
        target's calls, rather than in the next round's (on the 2-core CPU 140 tokens took the draft 1.1 s, and the
        round waited for them)."""
        ctx = self.ctx
        if ctx.draft_opening is not None and not self._waited_for_draft:
            # A draft about as fast as the target (both began the prompt together) is worth a short wait: decoding
            # without it means it catches up in a batch, whose numerics are not one-token decoding's.
            self._waited_for_draft = True
            grace_s = max(DRAFT_OPEN_GRACE * ctx.stats.prompt_ns / 1e9, self.options.plain_burst_ms / 1e3)
            await asyncio.wait([ctx.draft_opening], timeout=grace_s)
        if ctx.draft_pending():
            return True
        if ctx.draft_opening is not None and not await ctx.draft_opened():  # answered: take its outcome
            return False
        if self._joining:  # the draft answered after the target had decoded on without it
            behind = len(ctx.pos.unsent) > BACKGROUND_CATCH_UP and isinstance(self.strategy, ModelDraft)
            if behind and ctx.drafting and not ctx.pos.draft_has:
                ctx.catching_up = asyncio.ensure_future(ctx.propose([], 1, ctx.span))  # its one-token proposal unused
                return True
            self._joining = False  # caught up: from here on every round's Propose brings its own tokens
        return False

    async def _plain_while_draft_opens(self) -> AsyncIterator[pb.Token]:
        """One target-only call (the tokens the target computes in `plain_burst_ms`) while the draft's Open runs; the
        draft catches up on them at its first Propose. Waiting for the draft instead stalled a request after its first
        token for as long as the draft's prefill outlasted the target's."""
        ctx = self.ctx
        self._joining = True
        ctx.plain_done = None  # one call at a time: the time between answers holds a round trip, not a token's cost
        n = ctx.plain_steps(self.req.max_tokens - ctx.pos.produced)
        call = asyncio.ensure_future(ctx.verify([], [], ctx.span, timed=False, steps=n))
        result = await ctx.await_plain(call, time.perf_counter_ns())
        ctx.plain_done = None
        ctx.stats.tokens_before_draft += len(result.tokens)
        for token in result.tokens:
            yield token

    async def _open(self) -> pb.OpenResult:
        """Prefill the target and, in the background, the draft: the first token does not wait for the draft's
        prefill (on its own device), so TTFT with speculation is the target's alone; until it answers, the target
        decodes alone (`_draft_pending`)."""
        ctx = self.ctx
        sampling = pb.SamplingParams(
            temperature=self.req.sampling.temperature, top_k=self.req.sampling.top_k, top_p=self.req.sampling.top_p
        )
        if self.req.sampling.seed is not None:
            sampling.seed = self.req.sampling.seed
        item = pb.OpenItem(
            session_id=ctx.session_id,
            prompt_token_ids=self.req.prompt_token_ids,
            sampling=sampling,
            logprobs=self.req.top_logprobs >= 0,
            top_logprobs=max(self.req.top_logprobs, 0),
        )
        if self.req.constraint is not None:
            item.constraint.CopyFrom(constraint_to_pb(self.req.constraint))
        span = ctx.child("open")
        metadata = metadata_for(span)
        timeout = self.options.open_timeout_s
        try:
            target_call = ctx.up.target.Open(pb.OpenRequest(items=[item]), timeout=timeout, metadata=metadata)
            if not ctx.drafting or self.options.local_ngram:
                return (await target_call).results[0]
            if isinstance(self.strategy, CrossVocabDraft):  # the draft is opened with the prompt as text
                ctx.draft_opening = asyncio.ensure_future(self.strategy.open_draft(sampling, timeout, metadata))
                try:
                    return (await target_call).results[0]
                except BaseException:
                    await ctx.draft_opened()
                    raise
            draft_item = pb.OpenItem(
                session_id=ctx.session_id,
                prompt_token_ids=self.req.prompt_token_ids,
                sampling=sampling,
                draft_types=self.req.draft_types,
            )
            draft_info = ctx.up.draft_info
            if item.HasField("constraint") and draft_info is not None and draft_info.capabilities.constraints:
                draft_item.constraint.CopyFrom(item.constraint)  # a model draft masks its proposals the same way
            ctx.draft_opening = asyncio.ensure_future(
                ctx.up.draft.Open(pb.OpenRequest(items=[draft_item]), timeout=timeout, metadata=metadata)
            )
            try:
                return (await target_call).results[0]
            except BaseException:
                await ctx.draft_opened()  # so that the close below closes it
                raise
        finally:
            span.end()

    async def _close(self) -> None:
        """Free both sessions' KV; never let a failed close hide the request's own outcome. Shielded as one task: when
        the client disconnects the request's task is cancelled, but the Close calls must still go out."""
        closing = asyncio.ensure_future(self._close_both())
        self._closing = closing  # keep a reference until it is done
        await asyncio.shield(closing)

    async def _close_both(self) -> None:
        ctx = self.ctx
        if ctx.draft_opening is not None:
            await ctx.draft_opened()
        if ctx.catching_up is not None:  # its answer first, so that the Close does not fail it
            await asyncio.wait([ctx.catching_up])
            ctx.draft_pending()  # takes its outcome
        calls = [ctx.up.target.Close(pb.CloseRequest(session_ids=[ctx.session_id]), timeout=5)]
        if ctx.draft_open and ctx.up.draft is not None:
            calls.append(ctx.up.draft.Close(pb.CloseRequest(session_ids=[ctx.session_id]), timeout=5))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.debug("close of session %s failed: %s", ctx.session_id, r)
