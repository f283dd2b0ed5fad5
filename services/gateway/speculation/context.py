"""What the strategies of one generation share: the request, its two sessions' positions, the calls, the stats.

`Context` owns the bookkeeping every strategy needs in the same way: where the target and the draft sessions are,
which emitted tokens the draft has not seen yet, the Verify and Propose calls with their spans and timings, and the
switch to target-only decoding when the draft fails. A strategy decides what to send; the context sends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence

import grpc
from opentelemetry import trace

from services.gateway.adaptive import AcceptanceTracker
from services.gateway.costs import CostModel
from services.gateway.metrics import GatewayMetrics
from services.gateway.speculation.state import GenerationOptions, GenerationRequest, GenerationStats, Positions
from services.gateway.upstream import Upstreams
from tandem.telemetry import carrier_for, tracer
from tandem.v1 import tandem_pb2 as pb

log = logging.getLogger(__name__)

MAX_PLAIN_STEPS = 16  # the most tokens one target-only call asks for, however short the steps


def retrieve(call: asyncio.Future) -> None:
    """Done callback of a call nobody awaits any more: read its outcome so that asyncio does not log it."""
    if not call.cancelled():
        call.exception()


def traced(span: trace.Span) -> dict[str, dict[str, str]]:
    """The trace_context field of a request, or nothing when tracing is off (filling an empty protobuf map still
    costs its ABC checks, twice a round)."""
    carrier = carrier_for(span)
    return {"trace_context": carrier} if carrier else {}


async def cancel_calls(calls: Sequence[asyncio.Future | None]) -> None:
    """Cancel calls still in flight. Sent or not, the target's state stays valid: a call nobody reads computes a token
    nobody sees, and a skipped or stale one changes nothing; the session is closed right after."""
    pending = [call for call in calls if call is not None]
    for call in pending:
        call.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


class Context:
    """One generation's shared state and calls. Positions are sequence lengths as each service holds them."""

    def __init__(
        self,
        upstreams: Upstreams,
        request: GenerationRequest,
        options: GenerationOptions,
        metrics: GatewayMetrics | None,
        costs: CostModel,
    ) -> None:
        self.up = upstreams
        self.req = request
        self.opts = options
        self.metrics = metrics
        self.costs = costs
        self.session_id = uuid.uuid4().hex
        self.stats = GenerationStats(
            prompt_n=len(request.prompt_token_ids),
            synthetic_acceptance=upstreams.target_info.capabilities.synthetic_acceptance,
        )
        self.acceptance = AcceptanceTracker(max(request.n_max, 1))  # this request's per-position acceptance
        self.span: trace.Span = trace.INVALID_SPAN
        self.pos = Positions(draft=len(request.prompt_token_ids))
        self.drafting = False  # a drafter is in use; False once it failed or cannot pay
        self.draft_opening: asyncio.Future | None = None  # the draft's Open, finishing after the first token
        self.catching_up: asyncio.Future | None = None  # a Propose that only brings the draft up to date
        self.draft_open = False
        self.last_propose_ns = 0
        self.plain_done: int | None = None  # when the last pipelined target-only call answered
        self.started_ns = self.last_token_ns = 0
        self._drafted_seen = 0  # draft tokens already reported to the governor

    # ---------------------------------------------------------------- progress

    @property
    def room(self) -> int:
        """Tokens the request may still emit."""
        return self.req.max_tokens - self.pos.produced

    def emit(self, token: pb.Token) -> bool:
        """Count an emitted token; True when it ends the generation (end of text or max_tokens)."""
        self.pos.advance(token.id)
        now = time.perf_counter_ns()
        self.stats.predicted_n = self.pos.produced
        self.stats.predicted_ns = now - self.started_ns
        if self.metrics:
            if self.pos.produced > 1:
                self.metrics.inter_token.observe((now - self.last_token_ns) / 1e9)
            self.metrics.generation_tokens.inc()
        self.last_token_ns = now
        if self.costs.running is not None:  # the deployment's delivery, for the governor under load
            drafted, self._drafted_seen = self.stats.draft_n - self._drafted_seen, self.stats.draft_n
            self.costs.governor.emitted(1, drafted, self.costs.target_load(), self.costs.own_load())
        return token.is_eog or self.pos.produced >= self.req.max_tokens

    # ---------------------------------------------------------------- the drafter's health

    def draft_failed(self, exc: BaseException) -> None:
        log.warning("draft failed (%s); continuing target-only", exc)
        self.drafting = False
        self.stats.speculation = "degraded"
        if self.metrics:
            self.metrics.degraded.inc()

    def stop_drafting(self) -> None:
        """Adaptive k found that no draft length can pay here: the rest is target-only decoding."""
        log.info(
            "speculation stopped for session %s: a draft token costs %.2f ms, more than drafting can save per round",
            self.session_id,
            self.costs.draft_token_ns / 1e6,
        )
        self.drafting = False
        self.stats.speculation = "stopped"

    def draft_pending(self) -> bool:
        """Whether the draft is not ready to draft: still prefilling this request's prompt (its Open has not
        answered), or learning the tokens decoded meanwhile (`catching_up`)."""
        if self.draft_opening is not None and not self.draft_opening.done():
            return True
        if self.catching_up is not None:
            if not self.catching_up.done():
                return True
            task, self.catching_up = self.catching_up, None
            if not task.cancelled() and task.exception() is not None:
                self.draft_failed(task.exception())
        return False

    async def draft_opened(self) -> bool:
        """Wait for the draft's Open (once); False if it failed, which switches the request to target-only."""
        task, self.draft_opening = self.draft_opening, None
        if task is not None:
            try:
                await task
                self.draft_open = True
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                self.draft_failed(exc)
        return self.drafting

    # ---------------------------------------------------------------- calls

    def child(self, name: str, parent: trace.Span | None = None) -> trace.Span:
        parent = parent or self.span
        if not parent.is_recording():  # tracing off (or this trace not sampled): a child would be a no-op too
            return trace.INVALID_SPAN
        return tracer().start_span(name, context=trace.set_span_in_context(parent))

    def plain_steps(self, room: int) -> int:
        """Tokens the next target-only call asks for: as many as the target computes in `plain_burst_ms` (its measured
        one-token step), so that no token waits longer than that for the ones sent with it."""
        step_ns = self.costs.plain_step_ns
        burst_ns = self.opts.plain_burst_ms * 1e6
        if burst_ns <= 0 or not step_ns:
            return 1
        return max(1, min(MAX_PLAIN_STEPS, room, int(burst_ns // step_ns)))

    async def verify(
        self,
        drafts: list[int],
        dists: list,
        round_span: trace.Span,
        guess: int | None = None,
        position: int | None = None,
        timed: bool = True,
        steps: int = 1,
        stop_at_repeat: int = 0,
        lookup: pb.LookupRule | None = None,
        draft_text: pb.DraftText | None = None,
    ) -> tuple[pb.VerifyResult, pb.Timing]:
        """One Verify of `drafts` (or of a draft of another vocabulary, `draft_text`) at `position` (default: where the
        target is); with `steps` > 1, `stop_at_repeat` or `lookup`, a Continuation. `timed`: its wall time counts as
        verify time (pipelined calls account their own)."""
        v0 = time.perf_counter_ns()
        span = self.child("verify", round_span)
        item = pb.VerifyItem(
            session_id=self.session_id,
            position=self.pos.target if position is None else position,
            draft_token_ids=drafts,
            draft_distributions=dists,
        )
        if guess is not None:
            item.bonus_guess = guess
        if draft_text is not None:
            item.draft_text.CopyFrom(draft_text)
        if steps > 1 or stop_at_repeat or lookup is not None:
            item.continuation.plain_steps = steps if steps > 1 else 0
            item.continuation.stop_at_repeat = stop_at_repeat
            if lookup is not None:
                item.continuation.lookup.CopyFrom(lookup)
        try:
            reply = await self.up.verify.call(pb.VerifyRequest(items=[item], **traced(span)), self.opts.rpc_timeout_s)
        finally:
            span.end()
        if timed:
            self.stats.verify_ns += time.perf_counter_ns() - v0
            self.stats.verify_service_ns += reply.timing.total_ns
        self.stats.verify_forward_ns += reply.timing.forward_ns
        self.stats.verify_mask_ns += reply.timing.mask_ns
        self.stats.verify_calls += 1
        self.stats.verify_steps += max(reply.timing.steps, 1)
        return reply.results[0], reply.timing

    async def await_plain(self, call: asyncio.Future, since: int) -> pb.VerifyResult:
        """The answer of a pipelined Verify call without drafts, accounted for: the wait since `since` counts as verify
        time (the calls' own times overlap), and its steps feed the cost model and the round metrics, as does the time
        since the answer before it in the same stream (`CostModel.plain_token_ns`)."""
        result, timing = await call
        self.pos.target = result.position
        done = time.perf_counter_ns()
        round_ns = done - since
        # Rounds the target drafted in the call report their own steps; the cost line and the plain token's cost
        # come from the plain steps only.
        lookup_ns = sum(r.forward_ns for r in result.lookup_rounds)
        plain_steps = max(timing.steps, 1) - len(result.lookup_rounds)
        plain_tokens = len(result.tokens) - sum(r.accepted + 1 for r in result.lookup_rounds)
        if self.plain_done is not None and plain_tokens > 0:
            # Queued behind the call before it: the time between their answers is what its tokens cost.
            self.costs.observe_plain_token((done - self.plain_done - lookup_ns) / plain_tokens)
        self.plain_done = done
        self.stats.verify_ns += round_ns
        if plain_steps > 0:
            plain_ns = (timing.forward_ns - lookup_ns) // plain_steps
            self.costs.observe_verify(timing.step_tokens, timing.step_sequences, plain_ns)
            self.costs.observe_plain_step(plain_ns)
        if self.metrics:
            self.metrics.observe_round(0, 0, round_ns, timing.forward_ns)
        return result

    async def propose(
        self, tentative: list[int], max_tokens: int, span_parent: trace.Span, append_text: bytes | None = None
    ) -> pb.ProposeResponse | None:
        """One Propose: append what the draft has not seen (plus `tentative` drafts, when drafting ahead; or, to a draft
        of another vocabulary, `append_text`: their text) and ask for max_tokens more. Updates the draft position; a
        failure switches the request to target-only (None)."""
        if self.draft_opening is not None and not await self.draft_opened():
            return None
        d0 = time.perf_counter_ns()
        span = self.child("propose", span_parent)
        rewind = self.pos.rewind_to is not None
        sent = len(self.pos.unsent)
        item = pb.ProposeItem(
            session_id=self.session_id,
            position=self.pos.rewind_to if rewind else self.pos.draft,
            append_token_ids=[*self.pos.unsent, *tentative] if append_text is None else [],
            max_tokens=max_tokens,
            rewind=rewind,
            append_text=append_text or b"",
        )
        self.stats.propose_calls += 1
        self.last_propose_ns = time.perf_counter_ns()
        try:
            reply = await self.up.propose.call(pb.ProposeRequest(items=[item], **traced(span)), self.opts.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.draft_failed(exc)
            span.record_exception(exc)
            return None
        finally:
            span.end()
            self.stats.draft_ns += time.perf_counter_ns() - d0
        self.pos.draft = reply.proposals[0].position
        del self.pos.unsent[:sent]  # tokens emitted during the call (a catch-up beside target-only calls) stay unsent
        self.pos.rewind_to = None
        self.stats.draft_forward_ns += reply.timing.forward_ns
        self.stats.draft_service_ns += reply.timing.total_ns
        return reply

    def learn(
        self, drafts: list[int], result: pb.VerifyResult, timing: pb.Timing, draft_ns: int, proposed: int, round_ns: int
    ) -> None:
        """Feed the cost model (shared) and the acceptance tracker (this request) with what a round measured."""
        self.costs.observe_verify(timing.step_tokens, timing.step_sequences, timing.forward_ns)
        if proposed:
            self.costs.observe_draft(proposed, draft_ns)
        # The wait at the target for other sessions' steps is not the round's: a plain token waits alike (queue_ns).
        overhead = max(round_ns - timing.forward_ns - draft_ns - timing.queue_ns, 0)
        self.costs.observe_overhead(overhead, timing.step_sequences, alone=self.costs.own_load() <= 1)
        if drafts:
            self.acceptance.observe(len(drafts), result.num_accepted)
        if self.metrics:
            self.metrics.observe_round(len(drafts), result.num_accepted, round_ns, draft_ns + timing.forward_ns)
