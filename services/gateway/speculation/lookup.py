"""What the two prompt-lookup strategies share: rounds, and stretches of target-only decoding between repeats.

Prompt lookup drafts by copying: where the sequence ends with n tokens that occurred together earlier, the tokens
that followed them then are the draft. So it can draft only behind such a repeat, and the gateway knows where those
are. A round whose lookup finds nothing starts a *stretch*: target-only calls of several steps that the target ends
at the first repeat the lookup could draft behind (`Continuation.stop_at_repeat`), pipelined; the strategy applies
the same test (tandem.ngram.RepeatWatch) to the tokens it gets and, at a repeat, goes back to drafting. A round likely
to fail at its first draft sends the stretch's first call with it (a *follow-up*), which the target skips if the
round ends elsewhere. docs/decisions/0009 has the measurements behind each of these.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from services.gateway.adaptive import MatchLengthPolicy, worth_following_up
from services.gateway.speculation.context import Context, cancel_calls, retrieve
from tandem.ngram import MATCH_CAP, RepeatWatches
from tandem.v1 import tandem_pb2 as pb

# A stretch ends after this long without a Propose, so that a draft service's session never sits idle long enough to
# expire (its default idle timeout is 300 s); the next Propose, empty or not, starts a new stretch.
DRAFT_KEEPALIVE_NS = 60 * 10**9


@dataclass
class FollowUp:
    """A stretch's first call, sent ahead with a lookup round; the target skips it unless the round ends where it
    starts."""

    call: asyncio.Future
    steps: int
    stop_at_repeat: int
    span: trace.Span
    position: int

    def drop(self) -> None:
        """Not needed: the target skips it, or the generation ended. Cancelled without waiting for it (the target takes
        this session's later calls after it anyway); its span ends when it is done."""
        self.call.cancel()
        self.call.add_done_callback(self._collected)

    def _collected(self, call: asyncio.Future) -> None:
        retrieve(call)  # a skipped call's FAILED_PRECONDITION is expected, nothing to log
        self.span.end()


class LookupStrategy:
    """A prompt-lookup drafter (the gateway's own, or an n-gram draft service): rounds, stretches and follow-ups.

    Subclasses say where drafts come from (`propose`), which sequence the repeat tests read (`sequence_so_far`), and
    the shortest repeat the drafter drafts behind (`shortest_match`)."""

    name = "lookup"
    local = False  # the lookup runs in this process (else in an n-gram draft service)
    service_repeat = 0  # an n-gram service's declared shortest match (0: the lookup runs here)
    target_lookup = False  # the target drafts with this request's rule inside target-only calls (Continuation.lookup)
    continues_rounds = False  # a round likely to fail at once goes on as target-only decoding in the same call

    def __init__(self, ctx: Context, repeats_known: bool) -> None:
        """`repeats_known`: the gateway can tell where the drafter could draft (it runs the lookup, or the service
        declares its shortest match)."""
        self.ctx = ctx
        # Stretches need the next call's start known in advance, so they pipeline: one call in flight is no stretch.
        self.pipelines = repeats_known and ctx.opts.plain_pipeline > 1
        self.repeats = RepeatWatches()
        self.lookahead: list[int] = []  # an n-gram service's proposal past the last verified draft
        self.lookahead_match = 0
        req = ctx.req
        # Adaptive k by the match behind each draft (docs/decisions/0004); otherwise a fixed k.
        self.match_policy = MatchLengthPolicy(ctx.costs, req.n_min) if req.adaptive and repeats_known else None

    # ---------------------------------------------------------------- what subclasses provide

    async def propose(self, k: int, round_span: trace.Span) -> tuple[list[int], list, int, int]:
        """(draft tokens, distributions, draft compute ns, tokens proposed) for a round of at most k drafts."""
        raise NotImplementedError

    def sequence_so_far(self) -> Sequence[int]:
        """Prompt and every emitted token, for the repeat tests."""
        raise NotImplementedError

    def shortest_match(self) -> int:
        """The shortest suffix match the drafter drafts behind."""
        raise NotImplementedError

    def lookup_rule(self) -> pb.LookupRule | None:
        """This request's rule for the target to draft with (only where `target_lookup`)."""
        return None

    async def continued_round(
        self, drafts: list[int], dists: list, round_span: trace.Span
    ) -> tuple[pb.VerifyResult, pb.Timing, list[pb.Token], int]:
        raise NotImplementedError

    def keep_lookahead(self, drafts: list[int], result: pb.VerifyResult) -> None:
        """The lookahead stays valid only if every draft was accepted and the target's own token is its next one."""
        if self.lookahead and result.num_accepted == len(drafts) and result.tokens[-1].id == self.lookahead[0]:
            self.lookahead = self.lookahead[1:]
            self.lookahead_match += 1
        else:
            self.lookahead = []

    # ---------------------------------------------------------------- one round

    def choose_k(self) -> int:
        cap = self.ctx.room - 1
        if not self.ctx.drafting:
            return 0
        k = min(self.ctx.req.n_max, cap)
        if self.match_policy is None:  # the match policy chooses after the lookup (see propose)
            self.ctx.stats.k_chosen += k
            self.ctx.stats.k_rounds += 1
        return k

    async def round(self) -> AsyncIterator[pb.Token]:
        """Propose, verify, settle; or, where the lookup found nothing, a stretch of target-only decoding."""
        ctx = self.ctx
        k = self.choose_k()
        round_span = ctx.child("round")
        round_start = time.perf_counter_ns()
        follow: FollowUp | None = None
        stretch = False
        went_on: list[pb.Token] = []  # a continued round's target-only tokens
        went_on_ns = 0  # ... and the target's time computing them
        try:
            drafts, dists, draft_ns, proposed = await self.propose(k, round_span)  # 1. propose
            if not drafts and k > 0 and self.pipelines and ctx.drafting:
                stretch = True  # nothing to draft here: verify this round, and the ones after it, pipelined
            else:  # 2. verify
                follows = drafts and self.pipelines and worth_following_up(ctx.acceptance)
                if follows and self.continues_rounds:
                    result, timing, went_on, went_on_ns = await self.continued_round(drafts, dists, round_span)
                elif follows:
                    verifying = asyncio.ensure_future(ctx.verify(drafts, dists, round_span))
                    follow = self.follow_up()  # sent after the round's call, so the target runs it after
                    result, timing = await verifying
                else:
                    result, timing = await ctx.verify(drafts, dists, round_span)
        except BaseException:
            if follow is not None:
                follow.drop()
            raise
        finally:
            if not stretch:  # a stretch's first call is this round's verification: it ends the span
                round_span.end()
        if stretch:
            async with aclosing(self.stretch(round_span)) as tokens:
                async for token in tokens:
                    yield token
            return
        # 3. settle
        ctx.pos.target = result.position
        if drafts:
            ctx.stats.observe_round(len(drafts), result.num_accepted)
        self.keep_lookahead(drafts, result)
        if went_on:
            self.lookahead = []  # it continues the round's drafts, which the target's own tokens went past
        ctx.learn(drafts, result, timing, draft_ns, proposed, time.perf_counter_ns() - round_start - went_on_ns)
        if self.match_policy is not None:
            self.match_policy.observe(len(drafts), result.num_accepted)
        try:
            for token in result.tokens:
                yield token
            for token in went_on:  # the target decoded on to the next repeat
                self.draftless_round(counted=False)
                yield token
            # The target runs the follow-up unless it meets one of these tests (the same ones, on the same sequence);
            # passing the repeat test also means the lookup would not draft here.
            if (
                follow is not None
                and result.position == follow.position
                and not self.ends_with_repeat(follow.stop_at_repeat)
            ):
                live, follow = follow, None
                ctx.stats.follow_ups_used += 1
                async with aclosing(self.stretch(None, live)) as tokens:
                    async for token in tokens:
                        yield token
        finally:
            if follow is not None:
                follow.drop()  # the target skips it (wrong position, or a repeat), or nobody reads it

    def follow_up(self) -> FollowUp | None:
        """A stretch's first call, sent with a lookup round's Verify, for the case that the round ends at its first
        draft (the likeliest outcome on text that repeats little): otherwise the target idles for a round trip after
        such a round. It names position + 1 and the repeat floor, so the target skips it (FAILED_PRECONDITION, nothing
        changed) when the round ends elsewhere or where the lookup could draft. None when no token would be left."""
        ctx = self.ctx
        room = ctx.room - 1  # after the round's first token
        if room <= 0:
            return None
        n = ctx.plain_steps(room)
        floor = self.repeat_floor()
        position = ctx.pos.target + 1
        span = ctx.child("round")
        call = ctx.verify([], [], span, position=position, timed=False, steps=n, stop_at_repeat=floor)
        ctx.stats.follow_ups += 1
        return FollowUp(asyncio.ensure_future(call), n, floor, span, position)

    # ---------------------------------------------------------------- stretches

    async def stretch(self, first_round: trace.Span | None, follow: FollowUp | None = None) -> AsyncIterator[pb.Token]:
        """Target-only decoding up to the next repeat the lookup could draft behind.

        Calls of several plain steps with `stop_at_repeat` = the repeat floor, `plain_pipeline` of them in flight. The
        first is a one-token call (the lookup just declined at this position, whose suffix may repeat already); each
        later one starts where the ones before it end if none stops early. A call behind one that stopped early is
        skipped by the target (FAILED_PRECONDITION, nothing changed). At a repeat the stretch returns to the rounds,
        once the calls in flight have answered. A stretch for a draft service ends after DRAFT_KEEPALIVE_NS.

        Where the target runs the lookup itself (`target_lookup`), the calls carry the rule instead
        (Continuation.lookup) and nothing ends the stretch at a repeat; a call whose drafts took the sequence past the
        tokens it asked for leaves the calls behind it refused, and the stretch goes on from there once they are back.

        Each call is a round span; the first call's is `first_round`. A stretch can also start from a follow-up call
        already on its way (`follow`): it is then the first call.
        """
        ctx = self.ctx
        self.lookahead = []  # a continuation of the last proposal, which these tokens go past
        # (call, tokens it asks for, its stop_at_repeat, its round span)
        inflight: deque[tuple[asyncio.Future, int, int, trace.Span]] = deque()
        ctx.plain_done = None
        planned = 0  # tokens the calls in flight ask for
        sent = 0  # calls sent in this stretch
        counted = follow is None  # the round counted the first call's k (a follow-up has none of its own)
        if follow is not None:
            inflight.append((follow.call, follow.steps, follow.stop_at_repeat, follow.span))
            planned, sent = follow.steps, 1
        repeated = False  # the sequence reached a repeat (or a call ended early): send nothing more
        restart = False  # target lookup took a call past what it asked for: go on once the calls behind are back
        next_floor: int | None = None  # the floor the repeat check just computed, for the call sent next
        try:
            while True:
                while (
                    not repeated
                    and not restart
                    and len(inflight) < ctx.opts.plain_pipeline
                    and ctx.pos.produced + planned < ctx.req.max_tokens
                    and (sent == 0 or not self.draft_kept_waiting())  # the first call always: progress
                ):
                    lookup = None
                    if self.target_lookup:
                        n, floor = ctx.plain_steps(ctx.req.max_tokens - ctx.pos.produced - planned), 0
                        lookup = self.lookup_rule()
                    elif sent == 0:
                        n, floor = 1, 0
                    else:
                        n = ctx.plain_steps(ctx.req.max_tokens - ctx.pos.produced - planned)
                        floor = self.repeat_floor() if next_floor is None else next_floor
                        next_floor = None
                    position = ctx.pos.target + planned
                    span = first_round if sent == 0 and first_round is not None else ctx.child("round")
                    call = ctx.verify(
                        [], [], span, position=position, timed=False, steps=n, stop_at_repeat=floor, lookup=lookup
                    )
                    inflight.append((asyncio.ensure_future(call), n, floor, span))
                    planned += n
                    sent += 1
                if not inflight:
                    if restart:
                        restart = False
                        ctx.plain_done = None  # the next call is not queued behind another: no plain token's cost
                        continue
                    return
                call, n, _, span = inflight.popleft()
                planned -= n
                expected = ctx.pos.target + n
                first_call = counted and sent - len(inflight) == 1
                try:
                    result = await ctx.await_plain(call, time.perf_counter_ns())
                except grpc.aio.AioRpcError as exc:
                    if (repeated or restart) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        continue  # skipped, as it should be: behind a repeat or behind a call that ended early
                    raise
                finally:
                    span.end()
                rounds = {r.offset: r for r in result.lookup_rounds}
                drafted_until = 0  # tokens before this index belong to a round the target drafted
                for i, token in enumerate(result.tokens):
                    target_round = rounds.get(i)
                    if target_round is not None:
                        self.target_round(target_round, counted=first_call and i == 0)
                        drafted_until = i + target_round.accepted + 1
                    elif i >= drafted_until:
                        self.draftless_round(counted=first_call and i == 0)
                    yield token
                if not first_call:
                    ctx.stats.pipelined_rounds += len(result.tokens)
                if result.position != expected:
                    if self.target_lookup and result.lookup_rounds:
                        restart = True  # drafts took it further: the calls behind are refused, then go on
                    else:
                        repeated = True
                elif not repeated and not self.target_lookup:
                    if inflight:
                        repeated = self.ends_with_repeat(inflight[0][2])
                    else:  # nothing behind: the floor the next call would get (same state until it is sent)
                        next_floor = self.repeat_floor()
                        repeated = self.ends_with_repeat(next_floor)
        finally:
            if sent == 0 and first_round is not None:
                first_round.end()  # never sent (max_tokens reached): the round ends here
            await cancel_calls([call for call, _, _, _ in inflight])
            for _, _, _, span in inflight:
                span.end()

    def draft_kept_waiting(self) -> bool:
        """A draft service has had no Propose for DRAFT_KEEPALIVE_NS: end the stretch before its session expires."""
        return self.service_repeat > 0 and time.perf_counter_ns() - self.ctx.last_propose_ns > DRAFT_KEEPALIVE_NS

    # ---------------------------------------------------------------- accounting

    def target_round(self, done: pb.LookupRound, counted: bool) -> None:
        """Account for a round the target drafted with this request's rule as for one of ours (`counted`: the round
        already counted its k)."""
        ctx = self.ctx
        ctx.stats.observe_round(done.drafted, done.accepted)
        ctx.stats.target_rounds += 1
        ctx.costs.observe_verify(done.step_tokens, done.step_sequences, done.forward_ns)
        ctx.acceptance.observe(done.drafted, done.accepted)
        if self.match_policy is not None:
            self.match_policy.observe_round(done.match_len, done.drafted, done.accepted)
        if ctx.metrics:
            ctx.metrics.observe_round(done.drafted, done.accepted, done.forward_ns, done.forward_ns)
        if counted:
            return
        ctx.stats.k_rounds += 1
        if self.match_policy is not None:
            ctx.stats.k_chosen += done.drafted
        else:
            ctx.stats.k_chosen += min(ctx.req.n_max, max(ctx.room - 1, 0))

    def draftless_round(self, counted: bool) -> None:
        """Account for one round without a draft in a stretch as a round would (`counted`: its k is counted)."""
        if self.match_policy is not None:
            self.match_policy.observe(0, 0)
        if counted:
            return
        ctx = self.ctx
        ctx.stats.k_rounds += 1
        if self.match_policy is None:  # count the k the round would have had, as choose_k does
            ctx.stats.k_chosen += min(ctx.req.n_max, max(ctx.room - 1, 0))

    # ---------------------------------------------------------------- where the lookup could draft

    def repeat_floor(self) -> int:
        """The shortest suffix match the lookup would draft behind from here on (0: none), for `stop_at_repeat`.

        A draft needs a match of m tokens that the match policy keeps a draft behind (`best_k(m, drafted) >= lo` for
        drafted <= min(cap, m - 1)), so no shorter match can draft in the next call."""
        req = self.ctx.req
        cap = min(req.n_max, self.ctx.room - 1)
        lo = max(req.n_min, 1)
        if cap < lo:
            return 0
        if not self.local and self.match_policy is None:
            return self.service_repeat  # the service's own rule; shorter matches never draft there
        # An m-token match drafts at most m - 1 tokens, so it takes lo + 1 to draft lo.
        first = max(self.shortest_match(), lo + 1)
        if self.match_policy is not None:
            return self.match_policy.shortest_kept_match(first, cap)
        return first if first <= MATCH_CAP else 0

    def ends_with_repeat(self, n: int) -> bool:
        """The target's `stop_at_repeat` test on this request's sequence."""
        return n > 0 and self.repeats.ends_with_repeat(self.sequence_so_far(), n)
