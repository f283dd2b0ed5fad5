"""Rounds drafted by a draft model service: propose, verify, settle; the next draft overlapped with verification."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from services.gateway.adaptive import DraftLengthPolicy, worth_drafting_ahead
from services.gateway.speculation.context import Context
from tandem.v1 import tandem_pb2 as pb


def choose_draft_length(ctx: Context, policy: DraftLengthPolicy | None) -> int:
    """A model draft's k for this round: the policy's choice (adaptive k), else n_max, within the room left; counted
    in the request's stats. Shared by drafts of the target's vocabulary and of another (cross_vocab.py)."""
    cap = ctx.room - 1
    k = policy.choose(cap) if policy is not None else min(ctx.req.n_max, cap)
    ctx.stats.k_chosen += k
    ctx.stats.k_rounds += 1
    return k


class ModelDraft:
    """A draft model in its own service. One round:

      1. propose: the draft appends the tokens the target committed since the last round and proposes k tokens;
      2. verify: the target checks [pending, d1..dk] in one forward pass and adds its own token;
      3. settle: the tokens are emitted; the draft learns them at the next Propose.

    Overlapped drafting: when the round is likely to be accepted whole, the draft proposes one token more (its guess
    of the target's own token) and, while the target verifies, drafts the next round from there. If the guess was
    right the next round needs no Propose; otherwise the draft rewinds its tentative tokens at the next Propose.
    Adaptive k (`DraftLengthPolicy`) picks k from measured step costs and this request's acceptance, and stops
    drafting where no k can pay.
    """

    name = "model"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.overlap = ctx.opts.overlap if ctx.req.overlap is None else ctx.req.overlap
        self.policy = (
            # Overlapped, the draft's time hides behind verification, so its cost alone cannot rule drafting out.
            DraftLengthPolicy(
                ctx.costs, ctx.req.n_min, ctx.req.n_max, ctx.acceptance, stop_when_futile=not self.overlap
            )
            if ctx.req.adaptive
            else None
        )
        self.ahead: tuple[list[int], list] | None = None  # next round's draft, drafted during this verification
        self.guess: int | None = None  # the draft's guess for the target's token after this round's drafts

    def choose_k(self) -> int:
        return choose_draft_length(self.ctx, self.policy)

    async def round(self) -> AsyncIterator[pb.Token]:
        ctx = self.ctx
        k = self.choose_k()
        if self.policy is not None and self.policy.futile:
            ctx.stop_drafting()
            return
        round_span = ctx.child("round")
        round_start = time.perf_counter_ns()
        ahead: asyncio.Future | None = None
        try:
            drafts, dists, draft_ns, proposed = await self.propose(k, round_span)  # 1. propose
            guess = self.guess
            if guess is not None and drafts and ctx.drafting and worth_drafting_ahead(ctx.acceptance, len(drafts)):
                # While the target verifies, the draft goes on from its guess, as if every draft will be accepted.
                ahead = asyncio.ensure_future(ctx.propose([*drafts, guess], len(drafts) + 1, round_span))
            result, timing = await ctx.verify(drafts, dists, round_span, guess if ahead else None)  # 2. verify
        except BaseException:
            if ahead is not None:
                ahead.cancel()
            raise
        finally:
            round_span.end()
        if ahead is not None:  # 3. settle
            draft_ns += await self.settle_ahead(ahead, drafts, guess, result)
        ctx.pos.target = result.position
        if drafts:
            ctx.stats.observe_round(len(drafts), result.num_accepted)
        ctx.learn(drafts, result, timing, draft_ns, proposed, time.perf_counter_ns() - round_start)
        for token in result.tokens:
            yield token

    async def propose(self, k: int, round_span) -> tuple[list[int], list, int, int]:
        """Up to k draft tokens and their distributions: drafted ahead during the last verification, or asked for now.
        Returns (tokens, distributions, draft compute ns, tokens the service proposed)."""
        ctx = self.ctx
        self.guess = None
        if not ctx.drafting or k <= 0:
            self.ahead = None  # a plain round moves the sequence on: a draft-ahead no longer fits (state stays valid)
            return [], [], 0, 0
        if self.ahead is not None:  # drafted during the last verification, and still valid
            tokens, dists = self.ahead
            self.ahead = None
            ctx.stats.overlapped_rounds += 1
            self.guess = tokens[k] if self.overlap and len(tokens) > k else None
            return tokens[:k], dists[:k], 0, 0
        # When drafting ahead is likely to pay, propose one more token: the draft's guess of the target's own token.
        guessing = self.overlap and worth_drafting_ahead(ctx.acceptance, k)
        reply = await ctx.propose([], k + 1 if guessing else k, round_span)
        if reply is None:
            return [], [], 0, 0
        proposal = reply.proposals[0]
        drafts, dists = list(proposal.token_ids), list(proposal.distributions)
        compute, proposed = reply.timing.forward_ns, len(drafts)
        if guessing and len(drafts) > k:
            self.guess = drafts[k]
            drafts, dists = drafts[:k], dists[:k]
        if len(drafts) < max(ctx.req.n_min, 1):
            return [], [], compute, proposed
        return drafts, dists, compute, proposed

    async def settle_ahead(self, ahead: asyncio.Future, drafts: list[int], guess: int, result: pb.VerifyResult) -> int:
        """Keep the draft-ahead proposal if the target accepted every draft and its own token is the guess; otherwise
        mark the tentative tokens for a rewind at the next Propose. Returns draft compute ns."""
        ctx = self.ctx
        reply = await ahead
        if reply is None or not ctx.drafting:
            return 0
        proposal = reply.proposals[0]
        accepted = result.num_accepted
        if accepted == len(drafts) and result.tokens[-1].id == guess:
            # The draft guessed the whole round: its proposal continues the committed sequence (drafts + guess).
            self.ahead = (list(proposal.token_ids), list(proposal.distributions)) if proposal.token_ids else None
            ctx.pos.draft_has = accepted + 1
        else:
            ctx.pos.rewind_to = ctx.pos.draft - len(drafts) - 1 + accepted  # keep the accepted drafts only
            ctx.pos.draft_has = accepted
        ctx.pos.unsent = []  # of this round's emitted tokens, the draft lacks only those not counted in draft_has
        return reply.timing.forward_ns
