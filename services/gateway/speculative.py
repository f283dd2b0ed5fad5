"""The speculative loop: prefill both services, then rounds of Draft.Propose -> Target.Verify until done.

One round, with the target at sequence length n (its last emitted token not yet in its KV cache):
  1. the draft appends the tokens the target committed since the last round and proposes up to k tokens;
  2. the target evaluates [last token, d1..dk] in one forward pass, accepts a prefix d1..dj by the lossless rule,
     adds its own token, and rolls its KV back past the first rejection;
  3. the j + 1 tokens are yielded; the draft learns them at the next Propose.
Both calls name the position they expect, so a retried call is answered from memory instead of being applied twice.

If the draft fails (dies, times out, answers out of order), the request continues target-only: the target's state
alone defines the output, so no token is lost, repeated or altered.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from services.gateway.adaptive import (
    AcceptanceTracker,
    CostModel,
    DraftLengthPolicy,
    MatchLengthPolicy,
    worth_checking_first,
    worth_drafting_ahead,
    worth_following_up,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.upstream import Upstreams
from tandem.ngram import MATCH_CAP, NGRAM_MAX, NGRAM_MIN, PromptLookup, RepeatWatches
from tandem.sampling import SamplingParams
from tandem.telemetry import carrier_for, metadata_for, tracer
from tandem.v1 import tandem_pb2 as pb

log = logging.getLogger(__name__)

PLAIN_PIPELINE = 2  # default target-only Verify calls in flight per request (see Generation._plain_tokens)
PLAIN_BURST_MS = 100.0  # default time's worth of target-only tokens one Verify call asks for (Generation._plain_steps)
MAX_PLAIN_STEPS = 16  # the most tokens one target-only call asks for, however short the steps
# A lookup stretch ends after this long without a Propose, so that the draft service's session never sits idle long
# enough to expire (its default idle timeout is 300 s); the next Propose, empty or not, starts a new stretch.
DRAFT_KEEPALIVE_NS = 60 * 10**9


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    max_tokens: int
    n_max: int  # draft tokens per round (0 = target only)
    n_min: int = 0  # drafts shorter than this are not verified
    top_logprobs: int = -1  # -1 none, 0 chosen token only, n alternatives
    adaptive: bool = True  # choose k per round in [n_min, n_max] from measured costs and acceptance
    ngram_min: int = NGRAM_MIN  # the gateway's own lookup drafts behind suffix matches at least this long


@dataclass
class GenerationStats:
    """What a response reports in `timings`, plus the split of round time for benchmarks."""

    prompt_n: int = 0
    prompt_ns: int = 0
    predicted_n: int = 0
    predicted_ns: int = 0
    rounds: int = 0  # verify rounds that carried a draft
    verify_calls: int = 0  # all verify calls, with or without a draft
    verify_steps: int = 0  # target steps those calls ran (a target-only call may run several: plain_steps)
    lookahead_rounds: int = 0  # rounds whose draft came from the n-gram lookahead, with no Propose call
    propose_calls: int = 0  # Propose calls to the draft service (drafts-ahead included)
    proposes_skipped: int = 0  # Propose calls not sent: the n-gram service could not draft there (see _propose)
    overlapped_rounds: int = 0  # rounds whose draft was drafted during the previous verification
    pipelined_rounds: int = 0  # rounds without a draft sent before the previous one's answer (see _lookup_stretch)
    follow_ups: int = 0  # target-only calls sent ahead with a lookup round (see _follow_up)
    follow_ups_used: int = 0  # ... that the round's outcome let run: each saved the target a round trip idle
    continued_rounds: int = 0  # rounds whose call went on as target-only decoding (see Generation._continued_round)
    target_rounds: int = 0  # rounds the target drafted inside target-only calls with the gateway's rule
    checked_rounds: int = 0  # rounds whose first draft a one-token step checked on its own (see _checked_round)
    draft_n: int = 0
    draft_n_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    draft_ns: int = 0  # wall time of Propose calls seen by the gateway
    verify_ns: int = 0  # wall time of Verify calls seen by the gateway
    draft_forward_ns: int = 0  # time inside the draft model's forward passes
    verify_forward_ns: int = 0  # time inside the target's forward passes
    draft_service_ns: int = 0  # wall time of Propose calls inside the draft service (the rest of draft_ns is gRPC)
    verify_service_ns: int = 0  # wall time of Verify calls inside the target service
    speculation: str = "off"  # off | on | degraded (draft failed mid-request) | stopped (drafting cannot pay here)
    synthetic_acceptance: str = ""  # benchmark targets only: acceptance is imposed, the text is not valid
    k_chosen: int = 0  # sum of the draft lengths asked for, over rounds (adaptive k)
    k_rounds: int = 0

    def observe_round(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_n += proposed
        self.draft_n_accepted += accepted
        while len(self.accepted_per_position) < proposed:
            self.accepted_per_position.append(0)
            self.drafts_per_position.append(0)
        for i in range(proposed):
            self.drafts_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def timings(self) -> dict:
        prompt_ms = self.prompt_ns / 1e6
        predicted_ms = self.predicted_ns / 1e6
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round(self.prompt_n / (prompt_ms / 1e3), 3) if prompt_ms > 0 else None,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(self.predicted_n / (predicted_ms / 1e3), 3) if predicted_ms > 0 else None,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "acceptance_rate": round(self.draft_n_accepted / self.draft_n, 4) if self.draft_n else None,
            # Mean tokens emitted per verify round, bonus token included (vLLM's convention).
            "mean_accepted_length": round((self.draft_n_accepted + self.rounds) / self.rounds, 4)
            if self.rounds
            else None,
            "speculation": self.speculation,
            **({"synthetic_acceptance": self.synthetic_acceptance} if self.synthetic_acceptance else {}),
            "draft_length_mean": round(self.k_chosen / self.k_rounds, 3) if self.k_rounds else None,
            # tandem's own split of decode time, for benchmarks: compute inside each service vs everything else.
            "rounds": self.rounds,
            "verify_calls": self.verify_calls,
            "verify_steps": self.verify_steps,
            "lookahead_rounds": self.lookahead_rounds,
            "propose_calls": self.propose_calls,
            "proposes_skipped": self.proposes_skipped,
            "overlapped_rounds": self.overlapped_rounds,
            "pipelined_rounds": self.pipelined_rounds,
            "follow_ups": self.follow_ups,
            "follow_ups_used": self.follow_ups_used,
            "continued_rounds": self.continued_rounds,
            "target_rounds": self.target_rounds,
            "checked_rounds": self.checked_rounds,
            "draft_compute_ms": round(self.draft_forward_ns / 1e6, 3),
            "verify_compute_ms": round(self.verify_forward_ns / 1e6, 3),
            "draft_rpc_ms": round(self.draft_ns / 1e6, 3),
            "verify_rpc_ms": round(self.verify_ns / 1e6, 3),
            "draft_service_ms": round(self.draft_service_ns / 1e6, 3),
            "verify_service_ms": round(self.verify_service_ns / 1e6, 3),
            "accepted_per_position": list(self.accepted_per_position),
            "drafts_per_position": list(self.drafts_per_position),
        }


def _retrieve(call: asyncio.Future) -> None:
    """Done callback of a call nobody awaits any more: read its outcome so that asyncio does not log it."""
    if not call.cancelled():
        call.exception()


def _answered_otherwise(check: asyncio.Future, first: int) -> bool:
    """A checked round's step is back already with a token other than the draft's first: the rest would be refused."""
    if not check.done() or check.cancelled() or check.exception() is not None:
        return False
    result, _ = check.result()
    return result.tokens[0].id != first


def _traced(span: trace.Span) -> dict[str, dict[str, str]]:
    """The trace_context field of a request, or nothing when tracing is off: filling a protobuf map, even from an
    empty dict, goes through MutableMapping.update and its ABC checks, twice a round."""
    carrier = carrier_for(span)
    return {"trace_context": carrier} if carrier else {}


@dataclass
class _FollowUp:
    """A call sent ahead that the target may skip: a lookup round's follow-up (see Generation._follow_up), or the rest
    of a checked round's draft (Generation._checked_round)."""

    call: asyncio.Future
    steps: int
    stop_at_repeat: int
    span: trace.Span
    position: int

    def drop(self) -> None:
        """Not needed: the target skips it, or the generation ended. Cancelled without waiting for it (the target
        takes this session's later calls after it anyway, and a call not written yet is never sent); its span ends
        when it is done."""
        self.call.cancel()
        self.call.add_done_callback(self._collected)

    def _collected(self, call: asyncio.Future) -> None:
        _retrieve(call)  # a skipped call's FAILED_PRECONDITION is expected, nothing to log
        self.span.end()


class Generation:
    """One request's speculative decoding; iterate it for tokens, read `stats` at any time."""

    def __init__(
        self,
        upstreams: Upstreams,
        request: GenerationRequest,
        rpc_timeout_s: float,
        metrics: GatewayMetrics | None = None,
        costs: CostModel | None = None,
        overlap: bool = True,
        local_ngram: bool = False,
        plain_pipeline: int = PLAIN_PIPELINE,
        ngram_max: int = NGRAM_MAX,
        plain_burst_ms: float = PLAIN_BURST_MS,
        target_lookup: bool = True,
        check_first_draft: str = "never",
        continue_rounds: bool = True,
    ) -> None:
        self.up = upstreams
        self.plain_pipeline = plain_pipeline
        self.plain_burst_ns = plain_burst_ms * 1e6
        self.metrics = metrics
        self.req = request
        self.timeout = rpc_timeout_s
        self.session_id = uuid.uuid4().hex
        self.stats = GenerationStats(
            prompt_n=len(request.prompt_token_ids), synthetic_acceptance=upstreams.target_info.synthetic_acceptance
        )
        # Prompt lookup in this process (no draft service, no Propose RPC): the sequence so far and its index.
        self._local: PromptLookup | None = (
            PromptLookup(request.prompt_token_ids, request.ngram_min, ngram_max) if local_ngram else None
        )
        self._use_draft = (upstreams.draft is not None or self._local is not None) and request.n_max > 0
        # An n-gram draft service that proposes only behind a repeated suffix of this many tokens (its Info says so).
        self._service_repeat = (
            upstreams.draft_info.proposes_after_repeat
            if self._local is None and upstreams.draft is not None and upstreams.draft_info is not None
            else 0
        )
        # Whether an m-token match drafts at most m - 1 tokens: the local lookup's rule, and an n-gram service's unless
        # it was started without it (`--no-ngram-scaled`, its Info says so); then any match may draft k tokens.
        self._match_caps_draft = self._local is not None or not (
            upstreams.draft_info is not None and upstreams.draft_info.match_uncapped
        )
        # The sequence so far, for the repeat test of a draft service's stretches (the local lookup keeps its own).
        self._sequence: list[int] | None = list(request.prompt_token_ids) if self._service_repeat else None
        self._last_propose_ns = 0  # when the last Propose went out (a stretch for a draft service ends in time)
        # Rounds without a draft go out pipelined when the gateway knows which tokens would end them: the lookup
        # runs here, or the draft service drafts only behind a repeat (see _lookup_stretch).
        self._pipelines_lookup = (self._local is not None or self._service_repeat > 0) and plain_pipeline > 1
        # ... and where the target can run the gateway's lookup rule itself, its calls draft as the main loop would
        # (VerifyItem.lookup): a stretch then goes on through the repeats instead of ending at each.
        self._target_lookup = (
            target_lookup
            and self._local is not None
            and self._pipelines_lookup
            and upstreams.target_info.prompt_lookup
            and request.n_max > 0
        )
        self._ngram_max = ngram_max
        # A draft service's rounds may check their first draft with a one-token step sent with the Propose (see
        # _checked_round): `--check-first-draft`, off by default. Never for seeded sampled requests with a fixed k: a
        # check draws from the target's random stream differently from a whole round, and a choice that follows
        # timings would make one seed give different texts (the reason such requests keep a fixed k).
        seeded = request.sampling.seed is not None and not request.sampling.greedy
        usable = self._service_repeat > 0 and (request.adaptive or not seeded)
        self._check_first = check_first_draft if usable else "never"
        # A draft service's round likely to fail at once goes on as target-only decoding in the same call, where the
        # target can (its Info's continues_rounds), instead of carrying a follow-up call (see _continued_round).
        self._continues_rounds = continue_rounds and self._service_repeat > 0 and upstreams.target_info.continues_rounds
        self._finished = False  # set by _lookup_stretch when the generation ended inside it
        self._repeats = RepeatWatches()  # where the lookup could draft again (see _lookup_stretch)
        self._draft_open = False
        self._span: trace.Span = trace.INVALID_SPAN
        self._model_free_draft = self._local is not None or upstreams.draft_is_ngram
        self._target_pos = self._draft_pos = self._produced = 0
        self._unsent: list[int] = []
        self._lookahead: list[int] = []
        self._lookahead_match = 0  # the suffix match behind the lookahead's first token (Proposal.match_len)
        self._t1 = self._last = 0
        self._plain_done: int | None = None  # when the last pipelined plain call answered (None: none queued behind)
        self.costs = costs if costs is not None else CostModel()
        # Overlapped drafting (model drafters; the n-gram lookahead already has its next draft for free).
        self._overlap = overlap and not self._model_free_draft
        self._ahead: tuple[list[int], list] | None = None  # next round's draft, drafted during this verification
        self._guess: int | None = None  # the draft's guess for the target's token after this round's drafts
        self._rewind_to: int | None = None  # draft position to rewind to after a rejected draft-ahead
        self._draft_has = 0  # emitted tokens to come that the draft already received with a draft-ahead
        self._draft_opening: asyncio.Future | None = None  # the draft's Open, finishing after the first token
        self.acceptance = AcceptanceTracker(max(request.n_max, 1))  # this request's per-position acceptance
        # Adaptive k: prompt lookup in this process knows the match behind each draft, and keeps what pays of it;
        # other drafters are told k in advance, from the cost curve and the acceptance by position.
        self.match_policy = (
            MatchLengthPolicy(self.costs, request.n_min)
            if request.adaptive and (self._local is not None or self._service_repeat > 0)
            else None
        )
        self.policy = (
            # Overlapped, the draft's time hides behind verification, so its cost alone cannot rule drafting out; a
            # model-free drafter's tokens cost next to nothing, so only noise in the fit could.
            DraftLengthPolicy(
                self.costs,
                request.n_min,
                request.n_max,
                self.acceptance,
                stop_when_futile=not self._overlap and not self._model_free_draft,
            )
            if request.adaptive and self.match_policy is None
            else None
        )

    def _child(self, name: str, parent: trace.Span | None = None) -> trace.Span:
        parent = parent or self._span
        if not parent.is_recording():  # tracing off (or this trace not sampled): a child would be a no-op too
            return trace.INVALID_SPAN
        return tracer().start_span(name, context=trace.set_span_in_context(parent))

    def _sampling_pb(self) -> pb.SamplingParams:
        s = self.req.sampling
        msg = pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        if s.seed is not None:
            msg.seed = s.seed
        return msg

    def _draft_failed(self, exc: BaseException) -> None:
        log.warning("draft failed (%s); continuing target-only", exc)
        self._use_draft = False
        self.stats.speculation = "degraded"
        if self.metrics:
            self.metrics.degraded.inc()

    def _stop_drafting(self) -> None:
        """Adaptive k found that no draft length can pay here: the rest is target-only decoding, pipelined."""
        log.info(
            "speculation stopped for session %s: a draft token costs %.2f ms, more than drafting can save per round",
            self.session_id,
            self.costs.draft_token_ns / 1e6,
        )
        self._use_draft = False
        self.stats.speculation = "stopped"

    async def _open(self) -> pb.OpenResult:
        item = pb.OpenItem(
            session_id=self.session_id,
            prompt_token_ids=self.req.prompt_token_ids,
            sampling=self._sampling_pb(),
            logprobs=self.req.top_logprobs >= 0,
            top_logprobs=max(self.req.top_logprobs, 0),
        )
        span = self._child("open")
        try:
            return await self._open_both(item, metadata_for(span))
        finally:
            span.end()

    async def _open_both(self, item: pb.OpenItem, metadata) -> pb.OpenResult:
        target_call = self.up.target.Open(pb.OpenRequest(items=[item]), timeout=self.timeout, metadata=metadata)
        if not self._use_draft or self._local is not None:
            return (await target_call).results[0]
        draft_item = pb.OpenItem(
            session_id=self.session_id, prompt_token_ids=self.req.prompt_token_ids, sampling=self._sampling_pb()
        )
        # The first token does not wait for the draft's prefill: it finishes in the background (on its own device)
        # and the first Propose waits for it. TTFT with speculation is then the target's alone.
        self._draft_opening = asyncio.ensure_future(
            self.up.draft.Open(pb.OpenRequest(items=[draft_item]), timeout=self.timeout, metadata=metadata)
        )
        try:
            target_res = await target_call
        except BaseException:
            await self._draft_opened()  # so that the caller's finally closes it
            raise
        return target_res.results[0]

    async def _draft_opened(self) -> bool:
        """Wait for the draft's Open (once); False if it failed, which switches the request to target-only."""
        task, self._draft_opening = self._draft_opening, None
        if task is not None:
            try:
                await task
                self._draft_open = True
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                self._draft_failed(exc)
        return self._use_draft

    async def tokens(self) -> AsyncIterator[pb.Token]:
        """Emitted tokens in order; close the iterator (contextlib.aclosing) to free both sessions early."""
        t0 = time.perf_counter_ns()
        self._t1 = self._last = t0
        m = self.metrics
        if m:
            m.active_requests.inc()
        self._span = tracer().start_span(
            "tandem.generate",
            attributes={"tandem.prompt_tokens": len(self.req.prompt_token_ids), "tandem.n_max": self.req.n_max},
        )
        try:
            opened = await self._open()
            self._t1 = self._last = time.perf_counter_ns()
            self.stats.prompt_ns = self._t1 - t0
            self.stats.speculation = "on" if self._use_draft else "off"
            if m:
                m.ttft.observe(self.stats.prompt_ns / 1e9)
                m.prompt_tokens.inc(len(self.req.prompt_token_ids))
            self._target_pos = opened.position
            self._draft_pos = len(self.req.prompt_token_ids)
            self._unsent = []  # committed tokens the draft has not seen yet
            self._lookahead = []  # n-gram continuation past the last verified draft, reusable without a Propose
            self._produced = 0
            self._emitted(opened.first_token)
            yield opened.first_token
            if opened.first_token.is_eog:
                return
            while self._produced < self.req.max_tokens:
                if not self._use_draft:  # target-only from here on (no draft, n_max 0, or the draft failed)
                    async with aclosing(self._plain_tokens()) as plain:
                        async for token in plain:
                            yield token
                    return
                k = self._choose_k()
                if self.policy is not None and self.policy.futile:
                    self._stop_drafting()
                    continue
                if self._checks_first(k):
                    async with aclosing(self._checked_round(k)) as checked:
                        async for token in checked:
                            yield token
                    if self._finished:
                        return
                    continue
                round_span = self._child("round")
                round_start = time.perf_counter_ns()
                ahead: asyncio.Task | None = None
                follow: _FollowUp | None = None
                stretch = False
                went_on: list[pb.Token] = []  # a continued round's target-only tokens (see _continued_round)
                went_on_ns = 0  # ... and the target's time computing them
                try:
                    drafts, dists, draft_compute, proposed = await self._propose(k, round_span)
                    guess = self._guess
                    if not drafts and k > 0 and self._pipelines_lookup and self._use_draft:
                        # The lookup found no draft (k = 0 means a round the policy or max_tokens left undrafted:
                        # one plain round, as before, keeping a lookahead that still holds).
                        stretch = True  # verify it, and the rounds after it, pipelined
                    else:
                        if (
                            guess is not None
                            and drafts
                            and self._use_draft
                            and worth_drafting_ahead(self.acceptance, len(drafts))
                        ):
                            # Overlapped drafting: while the target verifies, the draft goes on from its guess of
                            # the target's own token, as if every draft will be accepted.
                            tentative = [*drafts, guess]
                            ahead = asyncio.ensure_future(self._propose_rpc(tentative, len(drafts) + 1, round_span))
                        follows = (
                            drafts and ahead is None and self._pipelines_lookup and worth_following_up(self.acceptance)
                        )
                        if follows and self._continues_rounds:
                            result, timing, went_on, went_on_ns = await self._continued_round(drafts, dists, round_span)
                        elif follows:
                            verifying = asyncio.ensure_future(self._verify(drafts, dists, round_span))
                            follow = self._follow_up()  # sent after the round's call, so the target runs it after
                            result, timing = await verifying
                        else:
                            result, timing = await self._verify(drafts, dists, round_span, guess if ahead else None)
                except BaseException:
                    if ahead is not None:
                        ahead.cancel()
                    if follow is not None:
                        follow.drop()
                    raise
                finally:
                    if not stretch:  # a stretch's first call is this round's verification: it ends the span
                        round_span.end()
                if stretch:
                    async with aclosing(self._lookup_stretch(round_span)) as stretch_tokens:
                        async for token in stretch_tokens:
                            yield token
                    if self._finished:
                        return
                    continue
                if ahead is not None:
                    draft_compute += await self._settle_ahead(ahead, drafts, guess, result)
                verify_compute = timing.forward_ns
                self._target_pos = result.position
                if drafts:
                    self.stats.observe_round(len(drafts), result.num_accepted)
                self._keep_lookahead(drafts, result)
                if went_on:
                    self._lookahead = []  # it continues the round's drafts, which the target's own tokens went past
                round_ns = time.perf_counter_ns() - round_start - went_on_ns
                self._learn(drafts, result, timing, draft_compute, proposed, round_ns)
                if m:
                    m.observe_round(len(drafts), result.num_accepted, round_ns, draft_compute + verify_compute)
                try:
                    for token in result.tokens:
                        last = self._emitted(token)
                        yield token
                        if last:
                            return
                    for token in went_on:  # the target decoded on to the next repeat: the main loop asks from there
                        self._draftless_round(counted=False)
                        last = self._emitted(token)
                        yield token
                        if last:
                            return
                    # The target runs the follow-up unless it meets one of these tests (the same ones, on the same
                    # sequence); passing the repeat test also means the lookup would not draft here.
                    if (
                        follow is not None
                        and result.position == follow.position
                        and not self._ends_with_repeat(follow.stop_at_repeat)
                    ):
                        live, follow = follow, None
                        self.stats.follow_ups_used += 1
                        async with aclosing(self._lookup_stretch(None, live)) as stretch_tokens:
                            async for token in stretch_tokens:
                                yield token
                        if self._finished:
                            return
                finally:
                    if follow is not None:
                        follow.drop()  # the target skips it (wrong position, or a repeat), or nobody reads it
        finally:
            self.stats.predicted_ns = time.perf_counter_ns() - self._t1
            self._span.set_attributes(
                {
                    "tandem.predicted_n": self.stats.predicted_n,
                    "tandem.draft_n": self.stats.draft_n,
                    "tandem.draft_n_accepted": self.stats.draft_n_accepted,
                    "tandem.speculation": self.stats.speculation,
                }
            )
            self._span.end()
            if m:
                m.active_requests.dec()
                if self.stats.predicted_ns > 0 and self.stats.predicted_n > 1:
                    m.decode_rate.observe(self.stats.predicted_n / (self.stats.predicted_ns / 1e9))
            await self._close()

    async def _plain_tokens(self) -> AsyncIterator[pb.Token]:
        """Target-only decoding with `plain_pipeline` Verify calls in flight for this session.

        Each call's position is known in advance, so the next call already waits at the target when a step ends and
        its step starts at once, instead of a gRPC round trip later (~1.3 ms against a ~14 ms step on the 2-core
        CPU). A call asks for several tokens where steps are short (`_plain_steps`): a message each way per token
        costs the gateway and the target ~10% of a step there. A call past the end (end of generation, a stop
        sequence, a client gone) computes tokens nobody reads; it is cancelled here and the session is closed right
        after. A call that comes back short (its steps after the first failed) leaves the calls behind it at the
        wrong position: they are cancelled and the next call, sent from where the session is, meets the error.
        """
        inflight: deque[tuple[asyncio.Future, int]] = deque()
        self._plain_done = None
        planned = 0  # tokens the calls in flight ask for
        try:
            while True:
                while len(inflight) < self.plain_pipeline and self._produced + planned < self.req.max_tokens:
                    n = self._plain_steps(self.req.max_tokens - self._produced - planned)
                    position = self._target_pos + planned
                    call = self._verify([], [], self._span, position=position, timed=False, steps=n)
                    inflight.append((asyncio.ensure_future(call), n))
                    planned += n
                if not inflight:
                    return
                call, n = inflight.popleft()
                planned -= n
                expected = self._target_pos + n
                result = await self._await_plain(call, time.perf_counter_ns())
                for token in result.tokens:
                    last = self._emitted(token)
                    yield token
                    if last:
                        return
                if result.position != expected:
                    await self._cancel_calls([c for c, _ in inflight])
                    inflight.clear()
                    planned = 0
        finally:
            await self._cancel_calls([c for c, _ in inflight])

    def _plain_steps(self, room: int) -> int:
        """Tokens the next target-only call asks for: as many as the target computes in `plain_burst_ms` (its
        measured one-token step), so that no token waits longer than that for the ones sent with it."""
        step_ns = self.costs.plain_step_ns
        if self.plain_burst_ns <= 0 or not step_ns:
            return 1
        return max(1, min(MAX_PLAIN_STEPS, room, int(self.plain_burst_ns // step_ns)))

    async def _await_plain(self, call: asyncio.Future, since: int) -> pb.VerifyResult:
        """The answer of a pipelined Verify call without drafts, accounted for: the wait since `since` counts as
        verify time (the calls' own times overlap), and the steps feed the cost model and the round metrics, as
        does the time since the answer before it in the same stream (`CostModel.plain_token_ns`)."""
        result, timing = await call
        self._target_pos = result.position
        done = time.perf_counter_ns()
        round_ns = done - since
        # Rounds the target drafted in the call report their own steps; the cost line and the plain token's cost
        # come from the plain steps only.
        lookup_ns = sum(r.forward_ns for r in result.lookup_rounds)
        plain_steps = max(timing.steps, 1) - len(result.lookup_rounds)
        plain_tokens = len(result.tokens) - sum(r.accepted + 1 for r in result.lookup_rounds)
        if self._plain_done is not None and plain_tokens > 0:
            # Queued behind the call before it: the time between their answers is what its tokens cost.
            self.costs.observe_plain_token((done - self._plain_done - lookup_ns) / plain_tokens)
        self._plain_done = done
        self.stats.verify_ns += round_ns
        if plain_steps > 0:
            plain_ns = (timing.forward_ns - lookup_ns) // plain_steps
            self.costs.observe_verify(timing.step_tokens, timing.step_sequences, plain_ns)
            self.costs.observe_plain_step(plain_ns)
        if self.metrics:
            self.metrics.observe_round(0, 0, round_ns, timing.forward_ns)
        return result

    @staticmethod
    async def _cancel_calls(calls: Sequence[asyncio.Future | None]) -> None:
        """Cancel calls still in flight. Sent or not, the target's state stays valid: a call nobody reads computes
        a token nobody sees, and a skipped or stale one changes nothing; the session is closed right after."""
        pending = [call for call in calls if call is not None]
        for call in pending:
            call.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _continued_round(
        self, drafts: list[int], dists: list, round_span: trace.Span
    ) -> tuple[pb.VerifyResult, pb.Timing, list[pb.Token], int]:
        """A lookup round that goes on as target-only decoding in the same call (Info.continues_rounds), where a round
        likely to fail at once would otherwise carry a follow-up call (`_follow_up`).

        The call asks for `_plain_steps` tokens past the round's first, with the repeat floor as `stop_at_repeat`: after
        the round the target decodes on its own until the sequence ends with a repeat the draft service could draft
        behind, as the stretch that would follow the round does, whatever the round accepted. One message each way
        where a round and its follow-up took two (and the target skipped the follow-up, a message each way for nothing,
        whenever the round accepted a draft); and after a round that accepted drafts and ended on no repeat, no round
        trip before that stretch's first call. The round's tokens arrive with the rest, a burst later.

        Returns the round's own answer and timing (as a plain Verify of the drafts would), the target-only tokens after
        it, and their forward time (not the round's)."""
        room = self.req.max_tokens - self._produced - 1  # after the round's first token
        if room <= 0:
            result, timing = await self._verify(drafts, dists, round_span)
            return result, timing, [], 0
        steps = 1 + self._plain_steps(room)
        result, timing = await self._verify(drafts, dists, round_span, steps=steps, stop_at_repeat=self._repeat_floor())
        own = result.lookup_rounds[0]  # the round itself: offset 0, match_len 0
        n = own.accepted + 1
        went_on = list(result.tokens[n:])
        plain_ns = timing.forward_ns - own.forward_ns
        self.stats.continued_rounds += 1
        if went_on:
            plain_steps = max(timing.steps - 1, 1)
            self.stats.pipelined_rounds += len(went_on)
            self.costs.observe_verify(timing.step_tokens, timing.step_sequences, plain_ns // plain_steps)
            self.costs.observe_plain_step(plain_ns // plain_steps)
            if self.metrics:
                self.metrics.observe_round(0, 0, plain_ns, plain_ns)
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
        )
        return round_result, round_timing, went_on, plain_ns

    def _follow_up(self) -> _FollowUp | None:
        """A lookup stretch's first call, sent with a lookup round's Verify, for the case that the round ends at its
        first draft (the target's own token at position + 1, the likeliest outcome on text that repeats little).

        Otherwise the target idles for a round trip after such a round: the gateway learns the outcome, looks the
        suffix up, finds nothing, and only then sends the stretch's first call. This call names position + 1 and the
        repeat floor, so the target skips it (FAILED_PRECONDITION, nothing changed) when the round ends elsewhere or
        where the lookup could draft; the gateway applies the same two tests to the round's answer and either goes
        on with it as a stretch (`_lookup_stretch`) or leaves it to be skipped. None when no token would be left."""
        room = self.req.max_tokens - self._produced - 1  # after the round's first token
        if room <= 0:
            return None
        n = self._plain_steps(room)
        floor = self._repeat_floor()
        position = self._target_pos + 1
        span = self._child("round")
        call = self._verify([], [], span, position=position, timed=False, steps=n, stop_at_repeat=floor)
        self.stats.follow_ups += 1
        return _FollowUp(asyncio.ensure_future(call), n, floor, span, position)

    async def _lookup_stretch(
        self, first_round: trace.Span | None, follow: _FollowUp | None = None
    ) -> AsyncIterator[pb.Token]:
        """Rounds without a draft (prompt lookup, here or in the draft service): target-only decoding up to the next
        repeat.

        The lookup found nothing to draft here, and it finds nothing until the sequence ends with n tokens that occurred
        together before, for n the shortest match the policy would draft behind (`_repeat_floor`; for an n-gram draft
        service, the length its Info declares). So the target decodes on its own until then: calls of several plain
        steps with `stop_at_repeat=n`, each ended by the target after the first token that makes such a repeat,
        `plain_pipeline` of them in flight. The first is a one-token call (the lookup just declined at this position,
        whose suffix may repeat already); each later one starts where the ones before it end if none stops early. A call
        behind one that stopped early is skipped by the target (FAILED_PRECONDITION, nothing changed): it starts at a
        repeat, or at a position the session is not at. The gateway applies the same test (`RepeatWatch`) to the tokens
        it gets, and at a repeat returns to the main loop, which looks the suffix up as it would have after any plain
        round; the calls still in flight answer first. Text that repeats nothing then decodes like target-only decoding,
        several tokens a message, and a draft service sees none of those rounds: its next Propose appends them all (a
        stretch of DRAFT_KEEPALIVE_NS ends early, so that the service's session does not expire meanwhile). Returns at
        the end of the generation too (then `_finished` is set).

        Where the target can run the lookup itself (`_target_lookup`: the gateway's --local-ngram, a target whose
        Info declares prompt_lookup), the calls carry the lookup rule instead of stop_at_repeat (`_lookup_rule`,
        VerifyItem.lookup): the target drafts before each step as the main loop would, and reports those rounds
        (`_target_round` accounts for them). Nothing then ends the stretch at a repeat; a call whose drafts took the
        sequence past the tokens it asked for leaves the calls behind it refused, and the stretch goes on from there
        once they are back. It returns at the end of the generation.

        Each call is a round span of its own, with its verify span below it; the first call's is `first_round`, the
        round whose lookup found nothing (its span ends with that call). A stretch can also start from a lookup
        round's follow-up call (`follow`, see `_follow_up`), already on its way: it is then the first call.
        """
        self._lookahead = []  # a continuation of the last proposal, which these tokens go past
        # (call, tokens it asks for, its stop_at_repeat, its round span)
        inflight: deque[tuple[asyncio.Future, int, int, trace.Span]] = deque()
        self._plain_done = None
        planned = 0  # tokens the calls in flight ask for
        sent = 0  # calls sent in this stretch
        counted = follow is None  # the main loop counted the first call's round (a follow-up has none of its own)
        if follow is not None:
            inflight.append((follow.call, follow.steps, follow.stop_at_repeat, follow.span))
            planned, sent = follow.steps, 1
        repeated = False  # the sequence reached a repeat (or a call ended early): send nothing more
        # The target drafts with the gateway's rule (self._target_lookup): a call that accepted drafts past what it
        # asked for leaves the calls behind it refused; once they are back, the stretch goes on from there.
        restart = False
        next_floor: int | None = None  # the floor the repeat check just computed, for the call sent next
        try:
            while True:
                while (
                    not repeated
                    and not restart
                    and len(inflight) < self.plain_pipeline
                    and self._produced + planned < self.req.max_tokens
                    and (sent == 0 or not self._draft_kept_waiting())  # the first call always: progress
                ):
                    lookup = None
                    if self._target_lookup:
                        n, floor = self._plain_steps(self.req.max_tokens - self._produced - planned), 0
                        lookup = self._lookup_rule()
                    elif sent == 0:
                        n, floor = 1, 0
                    else:
                        n = self._plain_steps(self.req.max_tokens - self._produced - planned)
                        floor = self._repeat_floor() if next_floor is None else next_floor
                        next_floor = None
                    position = self._target_pos + planned
                    span = first_round if sent == 0 and first_round is not None else self._child("round")
                    call = self._verify(
                        [], [], span, position=position, timed=False, steps=n, stop_at_repeat=floor, lookup=lookup
                    )
                    inflight.append((asyncio.ensure_future(call), n, floor, span))
                    planned += n
                    sent += 1
                if not inflight:
                    if restart and not self._finished:
                        restart = False
                        self._plain_done = None  # the next call is not queued behind another: no plain token's cost
                        continue
                    return
                call, n, _, span = inflight.popleft()
                planned -= n
                expected = self._target_pos + n
                first_call = counted and sent - len(inflight) == 1
                try:
                    result = await self._await_plain(call, time.perf_counter_ns())
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
                        self._target_round(target_round, counted=first_call and i == 0)
                        drafted_until = i + target_round.accepted + 1
                    elif i >= drafted_until:
                        self._draftless_round(counted=first_call and i == 0)
                    if self._emitted(token):
                        self._finished = True
                        yield token
                        return
                    yield token
                if not first_call:
                    self.stats.pipelined_rounds += len(result.tokens)
                if result.position != expected:
                    if self._target_lookup and result.lookup_rounds:
                        restart = True  # drafts took it further: the calls behind are refused, then go on
                    else:
                        repeated = True
                elif not repeated and not self._target_lookup:
                    if inflight:
                        repeated = self._ends_with_repeat(inflight[0][2])
                    else:  # nothing behind: the floor the next call would get (same state until it is sent)
                        next_floor = self._repeat_floor()
                        repeated = self._ends_with_repeat(next_floor)
        finally:
            if sent == 0 and first_round is not None:
                first_round.end()  # never sent (max_tokens reached): the round ends here
            await self._cancel_calls([call for call, _, _, _ in inflight])
            for _, _, _, span in inflight:
                span.end()

    def _draft_kept_waiting(self) -> bool:
        """A draft service has had no Propose for DRAFT_KEEPALIVE_NS: end the stretch before its session expires."""
        return self._service_repeat > 0 and time.perf_counter_ns() - self._last_propose_ns > DRAFT_KEEPALIVE_NS

    def _target_round(self, done: pb.LookupRound, counted: bool) -> None:
        """Account for a round the target drafted with this request's lookup rule as for one of the main loop's
        (`counted`: the main loop already counted its k)."""
        self.stats.observe_round(done.drafted, done.accepted)
        self.stats.target_rounds += 1
        self.costs.observe_verify(done.step_tokens, done.step_sequences, done.forward_ns)
        self.acceptance.observe(done.drafted, done.accepted)
        if self.match_policy is not None:
            self.match_policy.observe_round(done.match_len, done.drafted, done.accepted)
        if self.metrics:
            self.metrics.observe_round(done.drafted, done.accepted, done.forward_ns, done.forward_ns)
        if counted:
            return
        self.stats.k_rounds += 1
        if self.match_policy is not None:
            self.stats.k_chosen += done.drafted
        else:
            self.stats.k_chosen += min(self.req.n_max, max(self.req.max_tokens - self._produced - 1, 0))

    def _lookup_rule(self) -> pb.LookupRule:
        """This request's lookup rule, for the target to draft with (VerifyItem.lookup): the same proposals, and
        with adaptive k the match policy's rates and costs, the same ones its own rounds are chosen with.

        A round the target drafts costs no round trip, yet it is priced like one of the gateway's: the rates sent are
        a snapshot that cannot learn from the rounds of the calls still in flight, and short matches start from an
        optimistic prior, so the round trip's share works as a margin. Side by side on this CPU (two runs each), the
        adaptive lookup as separate services ran at 0.94 / 0.88x of target-only on sampled edits priced without it
        and 1.02 / 1.01x with it; chat, edit and sampled chat within the noise."""
        rule = pb.LookupRule(
            ngram_min=self.req.ngram_min,
            ngram_max=self._ngram_max,
            max_draft=self.req.n_max,
            min_draft=self.req.n_min,
            end_position=self._target_pos + self.req.max_tokens - self._produced,
        )
        priced = self.match_policy.pricing(self.req.n_max) if self.match_policy is not None else None
        if priced is not None:
            rule.bucket_rates.extend(priced[0])
            rule.round_costs.extend(priced[1])
            rule.plain_cost = priced[2]
        return rule

    def _draftless_round(self, counted: bool) -> None:
        """Account for one round without a draft in a lookup stretch as the main loop would (`counted`: the main loop
        already counted its k, as for the stretch's first round)."""
        if self.match_policy is not None:
            self.match_policy.observe(0, 0)
        if counted:
            return
        self.stats.k_rounds += 1
        if self.match_policy is None:  # count the k the round would have had, as _choose_k does
            cap = max(self.req.max_tokens - self._produced - 1, 0)
            # The draft-length policy (a model draft service with adaptive k) chooses every round, as its probe counters
            # expect; with no repeat behind the sequence, a round it would draft gets an empty proposal anyway.
            self.stats.k_chosen += self.policy.choose(cap) if self.policy is not None else min(self.req.n_max, cap)

    def _repeat_floor(self) -> int:
        """The shortest suffix match the lookup would draft behind from here on (0: none), for `stop_at_repeat`.

        A draft needs a match of m tokens with `_keeps(m, drafted)` for drafted <= min(cap, m - 1) (<= cap where a
        match does not cap the draft, `_match_caps_draft`), and keeping is monotone in `drafted`, so no match shorter
        than this floor can draft anywhere in the next call."""
        cap = min(self.req.n_max, self.req.max_tokens - self._produced - 1)
        lo = max(self.req.n_min, 1)
        if cap < lo:
            return 0
        if self._local is None and self.match_policy is None:
            return self._service_repeat  # the service's own rule; shorter matches never draft there
        # The shortest match the lookup drafts behind (a draft service: its own rule), raised to what the policy keeps.
        shortest = self.req.ngram_min if self._local is not None else self._service_repeat
        # Capped, an m-token match drafts at most m - 1 tokens, so it takes lo + 1 to draft lo; uncapped, lo will do.
        for m in range(max(shortest, lo + 1 if self._match_caps_draft else lo), MATCH_CAP + 1):
            if self._keeps(m, min(cap, m - 1) if self._match_caps_draft else cap):
                return m
        return 0

    def _ends_with_repeat(self, n: int) -> bool:
        """The target's `stop_at_repeat` test on this request's sequence (prompt and every emitted token)."""
        if n <= 0:
            return False
        if self._local is not None:
            self._local.tokens.extend(self._unsent)
            self._unsent = []
            sequence = self._local.tokens
        else:
            assert self._sequence is not None
            sequence = self._sequence
        return self._repeats.ends_with_repeat(sequence, n)

    def _keeps(self, match_len: int, drafted: int) -> bool:
        """Whether the main loop would send a lookup draft of `drafted` tokens behind a `match_len`-token match."""
        lo = max(self.req.n_min, 1)
        if self.match_policy is not None:
            return self.match_policy.best_k(match_len, drafted) >= lo
        return drafted >= lo

    def _choose_k(self) -> int:
        cap = self.req.max_tokens - self._produced - 1
        if not self._use_draft:
            return 0
        k = self.policy.choose(cap) if self.policy is not None else min(self.req.n_max, cap)
        if self.match_policy is None:  # the match policy chooses after the lookup (see _propose)
            self.stats.k_chosen += k
            self.stats.k_rounds += 1
        return k

    def _learn(
        self, drafts: list[int], result: pb.VerifyResult, timing: pb.Timing, draft_ns: int, proposed: int, round_ns: int
    ) -> None:
        """Feed the cost model (shared) and the acceptance tracker (this request) with what the round measured."""
        self.costs.observe_verify(timing.step_tokens, timing.step_sequences, timing.forward_ns)
        if proposed:
            self.costs.observe_draft(proposed, draft_ns)
        self.costs.observe_overhead(max(round_ns - timing.forward_ns - draft_ns, 0))
        if drafts:
            self.acceptance.observe(len(drafts), result.num_accepted)
        if self.match_policy is not None:
            self.match_policy.observe(len(drafts), result.num_accepted)

    def _emitted(self, token: pb.Token) -> bool:
        """Count an emitted token; True when it ends the generation (end of text or max_tokens)."""
        if self._draft_has:
            self._draft_has -= 1  # sent with a draft-ahead already
        else:
            self._unsent.append(token.id)
        if self._sequence is not None:
            self._sequence.append(token.id)
        self._produced += 1
        now = time.perf_counter_ns()
        self.stats.predicted_n = self._produced
        self.stats.predicted_ns = now - self._t1
        if self.metrics:
            if self._produced > 1:
                self.metrics.inter_token.observe((now - self._last) / 1e9)
            self.metrics.generation_tokens.inc()
        self._last = now
        return token.is_eog or self._produced >= self.req.max_tokens

    def _checks_first(self, k: int) -> bool:
        """Whether this round goes as a `_checked_round`: an n-gram draft service will be asked (no lookahead left,
        and the sequence ends with a repeat it drafts behind, and with adaptive k one the match policy drafts behind)
        and the cost model prefers it (`worth_checking_first`)."""
        return (
            self._check_first != "never"
            and self._use_draft
            and k > 0
            and not self._lookahead
            and self._ends_with_repeat(self._repeat_floor())
            and (self._check_first == "always" or worth_checking_first(self.acceptance, self.costs, k))
        )

    async def _checked_round(self, k: int) -> AsyncIterator[pb.Token]:
        """A round of an n-gram draft service whose first draft is checked by a one-token step of its own.

        The step goes out with the Propose, so the target computes the round's first token while the service looks
        the suffix up (its round trip hidden behind the step). The Propose comes back first: the other k - 1 drafts
        go out at once as a Verify named after the first draft (`if_pending`), which the target queues behind the
        step and runs only if the step emitted that token; otherwise it refuses it (nothing changed) and the round
        ends with the step's token, which is what a whole round would have emitted after rejecting its first draft,
        without verifying the k - 1 drafts behind it. Lossless as a whole round is: the step's token is the target's
        own, and the rest verifies by the usual rule. The draft's tokens past k are kept as the lookahead.

        Sets `_finished` when the generation ends here. The round is counted as a whole round: its drafts, and the
        accepted ones (0 after a failed check, else 1 plus what the rest accepted)."""
        round_span = self._child("round")
        round_start = time.perf_counter_ns()
        position = self._target_pos
        check = asyncio.ensure_future(self._verify([], [], round_span, position=position))
        rest: _FollowUp | None = None
        first: int | None = None
        rest_drafts: list[int] = []
        draft_compute = proposed = 0
        try:
            try:
                reply = await self._propose_rpc([], 2 * k + 1, round_span)
                if reply is not None:
                    proposal = reply.proposals[0]
                    draft_compute, proposed = reply.timing.forward_ns, len(proposal.token_ids)
                    drafts = self._take_proposal(list(proposal.token_ids), proposal.match_len, k)
                    if len(drafts) >= max(self.req.n_min, 1):
                        first, rest_drafts = drafts[0], drafts[1:]
                        self.stats.checked_rounds += 1
                    if first is not None and not _answered_otherwise(check, first):
                        call = self._verify(
                            rest_drafts, [], round_span, position=position + 1, timed=False, if_pending=first
                        )
                        rest = _FollowUp(asyncio.ensure_future(call), 0, 0, trace.INVALID_SPAN, position + 1)
                result, timing = await check
            except BaseException:
                check.cancel()
                check.add_done_callback(_retrieve)
                if rest is not None:
                    rest.drop()
                raise
            self._target_pos = result.position
            self.costs.observe_verify(timing.step_tokens, timing.step_sequences, timing.forward_ns)
            verify_compute = timing.forward_ns
            token = result.tokens[0]
            matched = first is not None and token.id == first
            # Counted as the whole round would count it: k drafted, accepted up to the first rejection.
            drafted = 1 + len(rest_drafts) if first is not None else 0
            accepted = 1 if matched else 0  # the rest adds its own below, when it ran
            tokens = [token]
            if rest is not None and matched and not token.is_eog and self._produced + 1 < self.req.max_tokens:
                checked_at = time.perf_counter_ns()
                live, rest = rest, None
                try:
                    rest_result, rest_timing = await live.call
                finally:
                    self.stats.verify_ns += time.perf_counter_ns() - checked_at
                self.stats.verify_service_ns += rest_timing.total_ns
                self._target_pos = rest_result.position
                self.costs.observe_verify(rest_timing.step_tokens, rest_timing.step_sequences, rest_timing.forward_ns)
                verify_compute += rest_timing.forward_ns
                accepted = 1 + rest_result.num_accepted
                self._keep_lookahead(rest_drafts, rest_result)
                tokens += rest_result.tokens
            else:
                self._lookahead = []
            if drafted:
                self.stats.observe_round(drafted, accepted)
                self.acceptance.observe(drafted, accepted)
            if self.match_policy is not None:
                self.match_policy.observe(drafted, accepted)
            if proposed:
                self.costs.observe_draft(proposed, draft_compute)
            round_ns = time.perf_counter_ns() - round_start
            self.costs.observe_overhead(max(round_ns - verify_compute - draft_compute, 0))
            if self.metrics:
                self.metrics.observe_round(drafted, accepted, round_ns, draft_compute + verify_compute)
        finally:
            round_span.end()
        try:
            for token in tokens:
                if self._emitted(token):
                    self._finished = True
                    yield token
                    return
                yield token
        finally:
            if rest is not None:
                rest.drop()  # refused by the target (the step emitted another token), or nobody reads it

    async def _propose(self, k: int, round_span: trace.Span) -> tuple[list[int], list, int, int]:
        """Up to k draft tokens (and their distributions): from the n-gram lookahead when it still holds, else
        from the draft service. Returns (tokens, distributions, draft compute ns, tokens the service proposed)."""
        self._guess = None
        if not self._use_draft or k <= 0:
            self._ahead = None  # a plain round moves the sequence on: a draft-ahead no longer fits (state stays valid)
            return [], [], 0, 0
        if self._local is not None:
            d0 = time.perf_counter_ns()
            drafts = self._local.propose(self._unsent, k)  # microseconds: no RPC, no draft service
            self._unsent = []
            if self.match_policy is not None:
                drafts = drafts[: self.match_policy.choose(self._local.last_match, len(drafts))]
                self.stats.k_chosen += len(drafts)
                self.stats.k_rounds += 1
            self.stats.draft_ns += time.perf_counter_ns() - d0
            return (drafts, [], 0, 0) if len(drafts) >= max(self.req.n_min, 1) else ([], [], 0, 0)
        if self._lookahead:
            drafts = self._take_proposal(self._lookahead, self._lookahead_match, k)
            if len(drafts) >= max(self.req.n_min, 1):
                self.stats.lookahead_rounds += 1
                return drafts, [], 0, 0
            if self.match_policy is not None and not drafts:
                return [], [], 0, 0  # the policy would not draft behind this match: no round trip to learn that again
            self._lookahead = []  # too short to verify: ask the service, which may find a longer continuation
        if self._ahead is not None:  # drafted during the last verification, and still valid
            tokens, dists = self._ahead
            self._ahead = None
            self.stats.overlapped_rounds += 1
            self._guess = tokens[k] if self._overlap and len(tokens) > k else None
            return tokens[:k], dists[:k], 0, 0
        if self._service_cannot_draft():
            self.stats.proposes_skipped += 1
            if self.match_policy is not None:  # as _take_proposal counts a round the policy leaves undrafted
                self.stats.k_rounds += 1
            return [], [], 0, 0
        # A deterministic, model-free drafter costs nothing per token: ask it for more than k and keep the rest.
        # When drafting ahead is likely to pay, a model drafter proposes one more token: its guess of the target's
        # own token (otherwise that token would cost a draft step for nothing).
        guessing = self._overlap and worth_drafting_ahead(self.acceptance, k)
        ask = 2 * k + 1 if self._model_free_draft else k + 1 if guessing else k
        drafts: list[int] = []
        dists: list = []
        compute = 0
        reply = await self._propose_rpc([], ask, round_span)
        match_len = 0
        if reply is not None:
            proposal = reply.proposals[0]
            drafts = list(proposal.token_ids)
            dists = list(proposal.distributions)
            compute = reply.timing.forward_ns
            match_len = proposal.match_len
        proposed = len(drafts)
        if guessing and len(drafts) > k:
            self._guess = drafts[k]
            drafts, dists = drafts[:k], dists[:k]
        elif self._model_free_draft:
            drafts = self._take_proposal(drafts, match_len, k)
        if len(drafts) < max(self.req.n_min, 1):
            self._lookahead = []  # it continues the drafts dropped here, not the sequence
            return [], [], compute, proposed
        return drafts, dists, compute, proposed

    def _service_cannot_draft(self) -> bool:
        """Whether an n-gram draft service would answer this Propose with nothing that gets drafted: it proposes only
        behind a repeated suffix (its Info's `proposes_after_repeat`), and the sequence does not end with a repeat as
        long as the shortest match the round would draft behind (`_repeat_floor`). The main loop then goes straight to
        a lookup stretch instead of spending a round trip, with the target idle, to learn that. After a round that
        accepted some drafts and ended on a token that repeats nothing, that was a Propose answered empty (4-6 per 100
        tokens at a fixed k = 8 in full17). A Propose still goes out at least every DRAFT_KEEPALIVE_NS, so that the
        service's session never sits idle long enough to expire."""
        if self._service_repeat <= 0 or not self._pipelines_lookup or self._draft_kept_waiting():
            return False
        return not self._ends_with_repeat(self._repeat_floor())

    async def _propose_rpc(self, tentative: list[int], max_tokens: int, span_parent: trace.Span):
        """One Propose: append what the draft has not seen (plus `tentative` drafts, when drafting ahead) and ask for
        max_tokens more. Updates the draft position; a failure switches the request to target-only (None)."""
        if self._draft_opening is not None and not await self._draft_opened():
            return None
        d0 = time.perf_counter_ns()
        span = self._child("propose", span_parent)
        rewind = self._rewind_to is not None
        item = pb.ProposeItem(
            session_id=self.session_id,
            position=self._rewind_to if rewind else self._draft_pos,
            append_token_ids=[*self._unsent, *tentative],
            max_tokens=max_tokens,
            rewind=rewind,
        )
        self.stats.propose_calls += 1
        self._last_propose_ns = time.perf_counter_ns()
        try:
            reply = await self.up.propose.call(pb.ProposeRequest(items=[item], **_traced(span)), self.timeout)
        except grpc.aio.AioRpcError as exc:
            self._draft_failed(exc)
            span.record_exception(exc)
            return None
        finally:
            span.end()
            self.stats.draft_ns += time.perf_counter_ns() - d0
        self._draft_pos = reply.proposals[0].position
        self._unsent = []
        self._rewind_to = None
        self.stats.draft_forward_ns += reply.timing.forward_ns
        self.stats.draft_service_ns += reply.timing.total_ns
        return reply

    async def _settle_ahead(self, ahead: asyncio.Task, drafts: list[int], guess: int, result: pb.VerifyResult) -> int:
        """Keep the draft-ahead proposal if the target accepted every draft and its own token is the proposal's
        first; otherwise mark the tentative tokens for a rewind at the next Propose. Returns draft compute ns."""
        reply = await ahead
        if reply is None or not self._use_draft:
            return 0
        proposal = reply.proposals[0]
        own = result.tokens[-1].id
        accepted = result.num_accepted
        if accepted == len(drafts) and own == guess:
            # The draft guessed the whole round: its proposal continues the committed sequence (drafts + guess).
            self._ahead = (list(proposal.token_ids), list(proposal.distributions)) if proposal.token_ids else None
            self._draft_has = accepted + 1
        else:
            self._rewind_to = self._draft_pos - len(drafts) - 1 + accepted  # keep the accepted drafts only
            self._draft_has = accepted
        self._unsent = []  # of this round's emitted tokens, the draft lacks only those not counted in _draft_has
        return reply.timing.forward_ns

    def _take_proposal(self, proposal: list[int], match_len: int, k: int) -> list[int]:
        """This round's drafts out of a model-free service's proposal (or the lookahead left of one), continuing a
        `match_len`-token match: up to k, and with adaptive k what the match policy keeps (0: not worth a round); the
        rest stays as the lookahead, to draft from without a Propose if the round is accepted whole."""
        n = min(k, len(proposal))
        if self.match_policy is not None:
            n = self.match_policy.choose(match_len, n)
            self.stats.k_chosen += n
            self.stats.k_rounds += 1
        self._lookahead, self._lookahead_match = proposal[n:], match_len + n
        return proposal[:n]

    def _keep_lookahead(self, drafts: list[int], result: pb.VerifyResult) -> None:
        """The lookahead stays valid only if every draft was accepted and the target's own token is its next one."""
        if self._lookahead and result.num_accepted == len(drafts) and result.tokens[-1].id == self._lookahead[0]:
            self._lookahead = self._lookahead[1:]
            self._lookahead_match += 1
        else:
            self._lookahead = []

    async def _verify(
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
        if_pending: int | None = None,
    ) -> tuple[pb.VerifyResult, pb.Timing]:
        v0 = time.perf_counter_ns()
        span = self._child("verify", round_span)
        try:
            reply = await self.up.verify.call(
                pb.VerifyRequest(
                    items=[
                        pb.VerifyItem(
                            session_id=self.session_id,
                            position=self._target_pos if position is None else position,
                            draft_token_ids=drafts,
                            draft_distributions=dists,
                            **({"bonus_guess": guess} if guess is not None else {}),
                            plain_steps=steps if steps > 1 else 0,
                            stop_at_repeat=stop_at_repeat,
                            lookup=lookup,
                            **({"if_pending": if_pending} if if_pending is not None else {}),
                        )
                    ],
                    **_traced(span),
                ),
                self.timeout,
            )
        finally:
            span.end()
        if timed:
            self.stats.verify_ns += time.perf_counter_ns() - v0
            self.stats.verify_service_ns += reply.timing.total_ns
        self.stats.verify_forward_ns += reply.timing.forward_ns
        self.stats.verify_calls += 1
        self.stats.verify_steps += max(reply.timing.steps, 1)
        return reply.results[0], reply.timing

    async def _close(self) -> None:
        """Free both sessions' KV; never let a failed close hide the request's own outcome.

        Shielded as one task: when the client disconnects, the request's task is cancelled (and stays cancelled
        under anyio), but the Close calls must still go out.
        """
        closing = asyncio.ensure_future(self._close_both())
        self._closing = closing  # keep a reference until it is done
        await asyncio.shield(closing)

    async def _close_both(self) -> None:
        if self._draft_opening is not None:
            await self._draft_opened()
        calls = [self.up.target.Close(pb.CloseRequest(session_ids=[self.session_id]), timeout=5)]
        if self._draft_open and self.up.draft is not None:
            calls.append(self.up.draft.Close(pb.CloseRequest(session_ids=[self.session_id]), timeout=5))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.debug("close of session %s failed: %s", self.session_id, r)
