"""Rounds drafted by an n-gram draft service (model-free prompt lookup in its own process)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import trace

from services.gateway.speculation.context import Context
from services.gateway.speculation.lookup import LookupStrategy
from tandem.v1 import tandem_pb2 as pb


class NgramService(LookupStrategy):
    """Prompt lookup in an n-gram draft service, with the gateway doing what it can without a round trip.

    - The service's tokens cost nothing, so each Propose asks for 2k + 1 and the rest is kept as the *lookahead*: if the
      round is accepted whole and the target's own token is the lookahead's next, the next round drafts from it with
      no Propose.
    - The service declares the shortest repeat it drafts behind (Capabilities.proposes_after_repeat), so the gateway
      skips a Propose that could only come back empty (the *Propose skip*) and goes straight to a stretch.
    - A round likely to fail at its first draft goes on as target-only decoding in the same Verify call (a *continued
      round*, where the target's Capabilities say continues_rounds), instead of carrying a follow-up call.
    """

    name = "ngram-service"

    def __init__(self, ctx: Context) -> None:
        self.service_repeat = ctx.up.draft_info.capabilities.proposes_after_repeat
        super().__init__(ctx, repeats_known=self.service_repeat > 0)
        self.continues_rounds = (
            ctx.opts.continue_rounds and self.service_repeat > 0 and ctx.up.target_info.capabilities.continues_rounds
        )
        if self.service_repeat:
            ctx.pos.sequence = list(ctx.req.prompt_token_ids)  # the repeat tests read the whole sequence

    def sequence_so_far(self) -> Sequence[int]:
        assert self.ctx.pos.sequence is not None
        return self.ctx.pos.sequence

    def shortest_match(self) -> int:
        return self.service_repeat

    async def propose(self, k: int, round_span: trace.Span) -> tuple[list[int], list, int, int]:
        """Up to k drafts: from the lookahead when it still holds, else from the service (unless it could only answer
        nothing). Returns (tokens, distributions, draft compute ns, tokens the service proposed)."""
        ctx = self.ctx
        lo = max(ctx.req.n_min, 1)
        if not ctx.drafting or k <= 0:
            return [], [], 0, 0
        if self.lookahead:
            drafts = self.take_proposal(self.lookahead, self.lookahead_match, k)
            if len(drafts) >= lo:
                ctx.stats.lookahead_rounds += 1
                return drafts, [], 0, 0
            if self.match_policy is not None and not drafts:
                return [], [], 0, 0  # the policy would not draft behind this match: no round trip to learn that again
            self.lookahead = []  # too short to verify: ask the service, which may find a longer continuation
        if self.service_cannot_draft():
            ctx.stats.proposes_skipped += 1
            if self.match_policy is not None:  # as take_proposal counts a round the policy leaves undrafted
                ctx.stats.k_rounds += 1
            return [], [], 0, 0
        reply = await ctx.propose([], 2 * k + 1, round_span)  # None: the service failed (target-only from here)
        proposal = reply.proposals[0] if reply is not None else pb.Proposal()
        compute = reply.timing.forward_ns if reply is not None else 0
        proposed = len(proposal.token_ids)
        drafts = self.take_proposal(list(proposal.token_ids), proposal.match_len, k)
        if len(drafts) < lo:
            self.lookahead = []  # it continues the drafts dropped here, not the sequence
            return [], [], compute, proposed
        return drafts, [], compute, proposed

    def take_proposal(self, proposal: list[int], match_len: int, k: int) -> list[int]:
        """This round's drafts out of a proposal continuing a `match_len`-token match: up to k, and with adaptive k what
        the match policy keeps (0: not worth a round); the rest stays as the lookahead."""
        n = min(k, len(proposal))
        if self.match_policy is not None:
            n = self.match_policy.choose(match_len, n)
            self.ctx.stats.k_chosen += n
            self.ctx.stats.k_rounds += 1
        self.lookahead, self.lookahead_match = proposal[n:], match_len + n
        return proposal[:n]

    def service_cannot_draft(self) -> bool:
        """Whether the service would answer this Propose with nothing that gets drafted: the sequence does not end with
        a repeat as long as the shortest match the round would draft behind. A Propose still goes out at least every
        DRAFT_KEEPALIVE_NS, so that the service's session never sits idle long enough to expire."""
        if self.service_repeat <= 0 or not self.pipelines or self.draft_kept_waiting():
            return False
        return not self.ends_with_repeat(self.repeat_floor())

    async def continued_round(
        self, drafts: list[int], dists: list, round_span: trace.Span
    ) -> tuple[pb.VerifyResult, pb.Timing, list[pb.Token], int]:
        """A round that goes on as target-only decoding in the same call, up to the next repeat the service could draft
        behind: one message each way where a round and its follow-up took two.

        Returns the round's own answer and timing (as a plain Verify of the drafts would), the target-only tokens after
        it, and their forward time (not the round's)."""
        ctx = self.ctx
        room = ctx.room - 1  # after the round's first token
        if room <= 0:
            result, timing = await ctx.verify(drafts, dists, round_span)
            return result, timing, [], 0
        steps = 1 + ctx.plain_steps(room)
        result, timing = await ctx.verify(drafts, dists, round_span, steps=steps, stop_at_repeat=self.repeat_floor())
        own = result.lookup_rounds[0]  # the round itself: offset 0, match_len 0
        n = own.accepted + 1
        went_on = list(result.tokens[n:])
        plain_ns = timing.forward_ns - own.forward_ns
        ctx.stats.continued_rounds += 1
        if went_on:
            plain_steps = max(timing.steps - 1, 1)
            ctx.stats.pipelined_rounds += len(went_on)
            ctx.costs.observe_verify(timing.step_tokens, timing.step_sequences, plain_ns // plain_steps)
            ctx.costs.observe_plain_step(plain_ns // plain_steps)
            if ctx.metrics:
                ctx.metrics.observe_round(0, 0, plain_ns, plain_ns)
        round_result = pb.VerifyResult(
            session_id=result.session_id,
            num_accepted=own.accepted,
            tokens=result.tokens[:n],
            position=result.position,  # where the session is: past the tokens after the round too
        )
        round_timing = pb.Timing(
            forward_ns=own.forward_ns,
            total_ns=timing.total_ns - plain_ns,
            step_sequences=own.step_sequences,
            step_tokens=own.step_tokens,
            steps=1,
            queue_ns=timing.queue_ns,  # the round is the call's first step: the call's wait came before it
        )
        return round_result, round_timing, went_on, plain_ns
