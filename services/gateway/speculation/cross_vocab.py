"""Rounds drafted by a model of another vocabulary than the target's: the draft works in text (decision 0015).

The draft never sees a target token id. It is opened with the prompt as text (the target's pieces, control tokens in
their markup), learns the committed text as bytes of the target's pieces, and proposes text. Two ways across:

- "string" (string-level drafting): the draft proposes its greedy continuation as text and the target tokenizes it
  inside Verify (VerifyItem.draft_text) and verifies the tokens as fixed drafts, as it verifies an n-gram draft: the
  output has exactly the target's distribution, greedy or sampled. A fixed draft d is accepted with probability
  p(d), which is largest at the draft's most likely token, so the draft proposes greedily whatever the request's
  temperature. No extra round trip: the translation happens in the call that verifies.
- "intersection" (token-level intersection, TLI): the draft samples from its distribution restricted to the tokens both
  vocabularies spell alike and sends the proposal in the target's ids with that q (the draft holds the target's
  vocabulary: PutVocabulary, once per draft process), verified by the usual min(1, p/q) rule.

A prompt longer than the draft's context, or a text that outgrows it, goes on target-only (`speculation:
"draft_context"`), never an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from services.gateway.adaptive import DraftLengthPolicy
from services.gateway.speculation.context import Context
from services.gateway.speculation.model_draft import choose_draft_length
from services.gateway.upstream import Upstreams
from tandem.convert import vocabulary_from_pb, vocabulary_to_pb
from tandem.cross_vocab import VocabularyText
from tandem.v1 import tandem_pb2 as pb

log = logging.getLogger(__name__)

MODES = ("auto", "string", "intersection")


async def target_vocabulary(up: Upstreams, timeout: float) -> VocabularyText:
    """The target's vocabulary as text, asked for once per target vocabulary and kept with the upstreams."""
    key = up.target_info.vocab_fingerprint
    fetch = up.vocabularies.get(key)
    if fetch is None:

        async def get() -> VocabularyText:
            reply = await up.target.GetVocabulary(pb.VocabularyRequest(), timeout=timeout)
            return vocabulary_from_pb(reply)

        fetch = up.vocabularies[key] = asyncio.ensure_future(get())
    try:
        return await asyncio.shield(fetch)
    except BaseException:
        if fetch.done() and up.vocabularies.get(key) is fetch:
            del up.vocabularies[key]  # a failed fetch is retried by the next request
        raise


class CrossVocabDraft:
    """A draft model of another vocabulary, in text. One round:

    1. propose: the draft learns the committed text since its last proposal and proposes up to k tokens of its own,
       answered as text (or, by intersection, as target ids with their q);
    2. verify: the target turns the text into its own tokens and verifies them as fixed drafts, then adds its token;
    3. settle: the tokens are emitted; the draft learns their text at the next Propose.
    """

    name = "cross-vocab"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.mode = ctx.req.cross_vocab or ctx.opts.cross_vocab
        if self.mode == "auto":  # what measured best on each (docs/decisions/0015)
            self.mode = "string" if ctx.req.sampling.greedy else "intersection"
        self.shared = self.mode == "intersection"
        self.policy = (
            DraftLengthPolicy(ctx.costs, ctx.req.n_min, ctx.req.n_max, ctx.acceptance, stop_when_futile=True)
            if ctx.req.adaptive
            else None
        )
        self.vocabulary: VocabularyText | None = None

    # ---------------------------------------------------------------- the draft's session

    async def open_draft(self, sampling: pb.SamplingParams, timeout: float, metadata) -> pb.OpenResponse | None:
        """Open the draft's session with the prompt as text; None (and target-only decoding) if the prompt does not fit
        the draft's context. Intersection: a draft that lacks the target's vocabulary gets it, then opens again."""
        ctx = self.ctx
        self.vocabulary = await target_vocabulary(ctx.up, timeout)
        item = pb.OpenItem(session_id=ctx.session_id, prompt_text=self.vocabulary.spell(ctx.req.prompt_token_ids, True))
        item.draft_types.extend(ctx.req.draft_types)
        if self.shared:
            item.sampling.CopyFrom(sampling)
            item.shared_vocabulary = self.vocabulary.fingerprint
        else:
            item.sampling.temperature = 0.0  # fixed drafts: the draft's greedy text (see the module's docstring)
        request = pb.OpenRequest(items=[item])
        try:
            reply = await ctx.up.draft.Open(request, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                self.draft_context(exc.details())
                return None
            if not (self.shared and exc.code() == grpc.StatusCode.FAILED_PRECONDITION):
                raise
            put = await ctx.up.draft.PutVocabulary(vocabulary_to_pb(self.vocabulary), timeout=timeout)
            log.info("sent the target's vocabulary to the draft: %d tokens shared", put.shared_tokens)
            reply = await ctx.up.draft.Open(request, timeout=timeout, metadata=metadata)
        ctx.pos.draft = reply.results[0].position  # bytes of text, from here on
        return reply

    def draft_context(self, why: str) -> None:
        """The text does not fit the draft's context (any more): the rest is target-only decoding."""
        log.info("session %s goes on target-only: %s", self.ctx.session_id, why)
        self.ctx.drafting = False
        self.ctx.stats.speculation = "draft_context"

    # ---------------------------------------------------------------- rounds

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
        try:
            proposal, draft_ns, proposed = await self.propose(k, round_span)
            if proposal is not None and self.shared and proposal.token_ids:
                drafts, dists = list(proposal.token_ids)[:k], list(proposal.distributions)[:k]
                result, timing = await ctx.verify(drafts, dists, round_span)
            elif proposal is not None and proposal.text:
                text = pb.DraftText(text=proposal.text, max_tokens=k)
                result, timing = await ctx.verify([], [], round_span, draft_text=text)
            else:
                result, timing = await ctx.verify([], [], round_span)
        finally:
            round_span.end()
        ctx.pos.target = result.position
        ctx.stats.translate_ns += timing.translate_ns
        if result.drafted:
            ctx.stats.observe_round(result.drafted, result.num_accepted)
        # learn() reads only how many tokens were drafted: the translation's count, in target tokens
        drafted = [0] * result.drafted
        ctx.learn(drafted, result, timing, draft_ns, proposed, time.perf_counter_ns() - round_start)
        for token in result.tokens:
            yield token

    async def propose(self, k: int, round_span) -> tuple[pb.Proposal | None, int, int]:
        """The draft's proposal after it learned the committed text; (proposal, draft compute ns, tokens asked)."""
        ctx = self.ctx
        if not ctx.drafting or k <= 0:
            return None, 0, 0
        if ctx.draft_opening is not None and not await ctx.draft_opened():
            return None, 0, 0
        if not ctx.drafting:  # the prompt did not fit the draft
            return None, 0, 0
        # A translation ending inside a target token loses its last token: one draft token more covers it.
        asked = k if self.shared else k + 1
        text = self.vocabulary.spell(ctx.pos.unsent) if self.vocabulary is not None else b""
        reply = await ctx.propose([], asked, round_span, append_text=text)
        if reply is None:
            return None, 0, 0
        ctx.stats.translate_ns += reply.timing.translate_ns
        proposal = reply.proposals[0]
        if proposal.context_full:
            self.draft_context("the text outgrew the draft's context")
        return proposal, reply.timing.forward_ns, asked
