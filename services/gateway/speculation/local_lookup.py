"""Rounds drafted by prompt lookup in the gateway itself (`--local-ngram`): no draft service, no Propose call."""

from __future__ import annotations

import time
from collections.abc import Sequence

from opentelemetry import trace

from services.gateway.speculation.context import Context
from services.gateway.speculation.lookup import LookupStrategy
from tandem.ngram import PromptLookup
from tandem.v1 import tandem_pb2 as pb


class LocalLookup(LookupStrategy):
    """The gateway's own prompt lookup: a draft costs microseconds and no round trip.

    Where the target can run the same rule (Capabilities.prompt_lookup), a stretch's calls carry it
    (Continuation.lookup) and the target drafts inside them as a round here would: a short draft then costs no round
    trip either (docs/decisions/0010)."""

    name = "local-ngram"
    local = True

    def __init__(self, ctx: Context) -> None:
        self.index = PromptLookup(ctx.req.prompt_token_ids, ctx.req.ngram_min, ctx.opts.ngram_max)
        super().__init__(ctx, repeats_known=True)
        self.target_lookup = (
            ctx.opts.target_lookup
            and self.pipelines
            and ctx.up.target_info.capabilities.prompt_lookup
            and ctx.req.n_max > 0
        )

    def sequence_so_far(self) -> Sequence[int]:
        self.index.tokens.extend(self.ctx.pos.unsent)
        self.ctx.pos.unsent = []
        return self.index.tokens

    def shortest_match(self) -> int:
        return self.ctx.req.ngram_min

    async def propose(self, k: int, round_span: trace.Span) -> tuple[list[int], list, int, int]:
        ctx = self.ctx
        if not ctx.drafting or k <= 0:
            return [], [], 0, 0
        d0 = time.perf_counter_ns()
        drafts = self.index.propose(ctx.pos.unsent, k)
        ctx.pos.unsent = []
        if self.match_policy is not None:
            drafts = drafts[: self.match_policy.choose(self.index.last_match, len(drafts))]
            ctx.stats.k_chosen += len(drafts)
            ctx.stats.k_rounds += 1
        ctx.stats.draft_ns += time.perf_counter_ns() - d0
        return (drafts, [], 0, 0) if len(drafts) >= max(ctx.req.n_min, 1) else ([], [], 0, 0)

    def lookup_rule(self) -> pb.LookupRule:
        """This request's lookup rule, for the target to draft with: the same proposals and, with adaptive k, the match
        policy's rates and costs. A round the target drafts costs no round trip, yet it is priced like one of ours: the
        rates are a snapshot that cannot learn from the calls in flight, so the round trip's share works as a margin."""
        ctx = self.ctx
        rule = pb.LookupRule(
            ngram_min=ctx.req.ngram_min,
            ngram_max=ctx.opts.ngram_max,
            max_draft=ctx.req.n_max,
            min_draft=ctx.req.n_min,
            end_position=ctx.pos.target + ctx.room,
        )
        priced = self.match_policy.pricing(ctx.req.n_max) if self.match_policy is not None else None
        if priced is not None:
            rule.bucket_rates.extend(priced[0])
            rule.round_costs.extend(priced[1])
            rule.plain_cost = priced[2]
        return rule
