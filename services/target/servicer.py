"""gRPC servicer for tandem.v1.Target: protobuf in, Verifier work through the step scheduler, protobuf out.

Verify calls from all requests are merged into one forward pass per engine step (continuous batching); Open is a
chunked job, so long prompts interleave with running streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from services.target.verifier import (
    EmittedToken,
    OpenSpec,
    PlainChain,
    StepShape,
    Verifier,
    VerifyResult,
    VerifySpec,
)
from tandem.convert import (
    constraint_from_pb,
    dist_from_pb,
    info_pb,
    lookup_rule_from_pb,
    sampling_from_pb,
    serving_stats,
    vocabulary_to_pb,
)
from tandem.cross_vocab import DraftTranslator, VocabularyText
from tandem.errors import InvalidArgument, TandemError
from tandem.frames import VERIFY, FrameMethod
from tandem.grpc_server import FrameOffer, ServiceLoading, stream_replies
from tandem.ngram import LookupRule
from tandem.scheduler import Again, StepScheduler
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tandem.worker import EngineWorker

T = TypeVar("T")


def token_to_pb(token: EmittedToken) -> pb.Token:
    msg = pb.Token(id=token.token_id, piece=token.piece, is_eog=token.is_eog)
    if token.logprob is not None:
        msg.logprob = token.logprob
        msg.top_logprobs.extend(pb.TopLogprob(id=t, piece=piece, logprob=lp) for t, piece, lp in token.top_logprobs)
    return msg


class _PlainRun:
    """One multi-token call's progress between its steps. `then` runs where each step ran (the engine thread, or the
    serving thread for an inline step) and says what to compute next: see StepScheduler.batched."""

    def __init__(
        self, specs: list[VerifySpec], steps: list[int], lookups: list[LookupRule | None], repeats: list[int]
    ) -> None:
        self.specs = specs
        self.chains = [
            PlainChain(spec.position, n, stop_at_repeat=repeat, lookup=rule, drafts=tuple(spec.draft_tokens))
            for spec, n, rule, repeat in zip(specs, steps, lookups, repeats, strict=True)
        ]
        self.results: list[VerifyResult] | None = None
        self.going = list(range(len(specs)))  # items that want more tokens
        self.steps = 0
        self.forward_ns = 0
        # Steps without a lookup round: their count and shape summed (with the sessions they shared a pass with),
        # for the caller's cost line; a lookup round reports its own step.
        self.plain_steps = 0
        self.step_tokens = 0
        self.step_sequences = 0
        self.started_ns = 0  # when the call's first step began (its queue time ends there)

    def first(self) -> list[VerifySpec]:
        return [dataclasses.replace(spec, chain=chain) for spec, chain in zip(self.specs, self.chains, strict=True)]

    def then(self, outcome: list[VerifyResult] | BaseException) -> Again | list[VerifyResult] | BaseException:
        if isinstance(outcome, BaseException):
            if self.results is None or not isinstance(outcome, TandemError):
                return outcome  # the first step fails the call as a whole
            return self.results  # the tokens so far stand; the next call meets the error
        self.steps += 1
        before = [len(self.results[i].lookup_rounds) if self.results else 0 for i in self.going]
        if self.results is None:
            self.results = list(outcome)
        else:
            for i, answer in zip(self.going, outcome, strict=True):
                self.results[i] = answer  # it carries the call's earlier tokens too (PlainChain.earlier)
        if outcome:
            step = outcome[0].step
            self.forward_ns += step.forward_ns
            self.started_ns = self.started_ns or step.started_ns
            if all(len(self.results[i].lookup_rounds) == n for i, n in zip(self.going, before, strict=True)):
                self.plain_steps += 1
                self.step_tokens += step.tokens
                self.step_sequences += step.sequences
        self.going = [i for i, chain in enumerate(self.chains) if not chain.done(self.results[i])]
        if not self.going:
            return self.results
        return Again(
            [
                VerifySpec(
                    self.specs[i].session_id,
                    self.results[i].position,
                    (),
                    None,
                    chain=dataclasses.replace(
                        self.chains[i], earlier=self.results[i].tokens, earlier_rounds=self.results[i].lookup_rounds
                    ),
                )
                for i in self.going
            ]
        )


def _continues(item: pb.VerifyItem) -> bool:
    """Whether an item is a round that goes on as target-only decoding (drafts and a Continuation: continues_rounds)."""
    return bool(item.draft_token_ids) and item.continuation.plain_steps > 1


def _lookup_rule(item: pb.VerifyItem) -> LookupRule | None:
    """The caller's prompt-lookup rule of a target-only call (Continuation.lookup), checked."""
    if not item.continuation.HasField("lookup"):
        return None
    if item.draft_token_ids or item.continuation.stop_at_repeat:
        raise InvalidArgument("lookup needs an item without draft tokens and without stop_at_repeat")
    try:
        return lookup_rule_from_pb(item.continuation.lookup)
    except ValueError as exc:
        raise InvalidArgument(f"lookup: {exc}") from exc


class TargetServicer(pb_grpc.TargetServicer):
    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.verifier: Verifier | None = None
        self.scheduler: StepScheduler | None = None
        self.frames: FrameOffer | None = None  # set by the service's main when it serves frames (tandem/frames.py)
        self._background: set[asyncio.Task] = set()
        #: Multi-token plain calls in progress, by session: a call queued behind one (the gateway pipelines them)
        #: waits for it to end, or its first step would run between that call's steps, at the wrong position.
        self._chains: dict[str, asyncio.Future] = {}
        #: Whether a Verify carrying a bonus guess may run inline. Such a call means the draft is drafting ahead
        #: meanwhile; in one process (co-located) that draft must not wait behind a target step on the event loop.
        self.inline_guessed = True
        #: Cross-vocabulary drafting: the vocabulary as text and the draft-text translator, each built once (off the
        #: event loop: a pass over every token).
        self._vocabulary: asyncio.Future | None = None
        self._translator: asyncio.Future | None = None

    def attach(
        self, verifier: Verifier, max_batch: int = 64, batch_wait_ms: float = 20.0, inline_steps: bool = False
    ) -> None:
        """Start serving with a loaded model."""
        scheduler = StepScheduler(
            self.worker,
            before_step=verifier.reclaim,
            max_groups=max_batch,
            max_gather_s=batch_wait_ms / 1e3,
            inline=self._inline_for(verifier) if inline_steps else None,
        )
        scheduler.register("verify", verifier.verify_groups)
        self.scheduler = scheduler
        self.verifier = verifier

    def _inline_for(self, verifier: Verifier):
        def inline(specs) -> bool:
            if len(verifier.store) > 1:
                return False
            return self.inline_guessed or all(spec.bonus_guess is None for spec in specs)

        return inline

    async def expire_idle(self) -> None:
        if self.verifier is not None and self.scheduler is not None:
            await self.scheduler.job(self.verifier.expire_idle)

    def _ready(self) -> Verifier:
        if self.verifier is None or self.scheduler is None:
            raise ServiceLoading("the target model is still loading")
        return self.verifier

    def _timing(self, t0: int, forward0: int, step=None) -> pb.Timing:
        """The call's timing; a verify call reports the forward time of the step that served it, not of every step
        that ran while it waited (with calls queued behind each other, that would count a step twice)."""
        assert self.verifier is not None
        timing = pb.Timing(forward_ns=self.verifier.engine.forward_ns - forward0, total_ns=time.perf_counter_ns() - t0)
        if step is not None:
            timing.step_sequences, timing.step_tokens = step.sequences, step.tokens
            timing.forward_ns = step.forward_ns
            if step.started_ns:
                timing.queue_ns = max(step.started_ns - t0, 0)
        return timing

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        v = self._ready()
        msg = serving_stats(info_pb(v.engine), v.store, self.scheduler, v.engine)
        msg.capabilities.synthetic_acceptance = v.synthetic_label
        msg.capabilities.prompt_lookup = True
        msg.capabilities.continues_rounds = True
        msg.capabilities.constraints = True
        msg.capabilities.translates_text = True
        msg.frame_port = self.frames.bound if self.frames is not None else 0
        return msg

    def frame_methods(self) -> dict[int, FrameMethod]:
        return {VERIFY: FrameMethod(pb.VerifyRequest, pb.VerifyResponse, self.Verify, "/tandem.v1.Target/Verify")}

    async def GetVocabulary(self, request: pb.VocabularyRequest, context: grpc.aio.ServicerContext) -> pb.Vocabulary:
        v = self._ready()
        if self._vocabulary is None:
            self._vocabulary = asyncio.ensure_future(
                asyncio.to_thread(lambda: vocabulary_to_pb(VocabularyText.of_engine(v.engine)))
            )
        vocabulary = await asyncio.shield(self._vocabulary)
        await self.translator()  # a gateway asks for the vocabulary before its first cross-vocabulary request
        return vocabulary

    async def translator(self) -> DraftTranslator:
        v = self._ready()
        if self._translator is None:
            self._translator = asyncio.ensure_future(asyncio.to_thread(DraftTranslator, v.engine))
        return await asyncio.shield(self._translator)

    async def _translate(self, items) -> tuple[list[list[int]], int]:
        """Each item's draft tokens: its draft_token_ids, or its draft_text in this vocabulary; and the time taken."""
        drafts = [list(item.draft_token_ids) for item in items]
        if not any(item.HasField("draft_text") for item in items):
            return drafts, 0
        translator = await self.translator()
        t0 = time.perf_counter_ns()
        for i, item in enumerate(items):
            if item.HasField("draft_text"):
                if item.draft_token_ids or item.draft_distributions:
                    raise InvalidArgument("draft_text replaces draft_token_ids and draft_distributions")
                limit = item.draft_text.max_tokens or translator.engine.n_ctx
                drafts[i] = translator.tokens(item.draft_text.text, limit)
        return drafts, time.perf_counter_ns() - t0

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        v = self._ready()
        ids = await self.scheduler.job(
            lambda: v.engine.tokenize(request.text, request.add_special, request.parse_special)
        )
        return pb.TokenizeResponse(token_ids=ids)

    async def Open(self, request: pb.OpenRequest, context: grpc.aio.ServicerContext) -> pb.OpenResponse:
        v = self._ready()
        t0, f0 = time.perf_counter_ns(), v.engine.forward_ns
        specs = [
            OpenSpec(
                item.session_id,
                list(item.prompt_token_ids),
                sampling_from_pb(item.sampling),
                item.top_logprobs if item.logprobs else -1,
                constraint_from_pb(item),
            )
            for item in request.items
        ]
        results = await self.scheduler.job(lambda: v.open_steps(specs))
        return pb.OpenResponse(
            results=[
                pb.OpenResult(session_id=r.session_id, position=r.position, first_token=token_to_pb(r.first_token))
                for r in results
            ],
            timing=self._timing(t0, f0),
        )

    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.VerifyResponse:
        v = self._ready()
        t0, f0 = time.perf_counter_ns(), v.engine.forward_ns
        drafts, translate_ns = await self._translate(request.items)
        specs = [
            VerifySpec(
                item.session_id,
                item.position,
                draft,
                [dist_from_pb(d, v.engine.n_vocab) for d in item.draft_distributions]
                if item.draft_distributions
                else None,
                item.bonus_guess if item.HasField("bonus_guess") else None,
                # A round that goes on (drafts and a Continuation) ends at a repeat; it is never skipped for one.
                stop_at_repeat=0 if _continues(item) else item.continuation.stop_at_repeat,
            )
            for item, draft in zip(request.items, drafts, strict=True)
        ]
        steps = [max(item.continuation.plain_steps, 1) for item in request.items]
        lookups = [_lookup_rule(item) for item in request.items]
        before = {self._chains[spec.session_id] for spec in specs if spec.session_id in self._chains}
        masks0 = v.grammar_ns([spec.session_id for spec in specs])
        if max(steps, default=1) > 1 or any(lookups):
            run = _PlainRun(specs, steps, lookups, [item.continuation.stop_at_repeat for item in request.items])
            results = await self._in_order(before, specs, lambda: self._plain_chains(run))
            # The plain steps' mean shape against their mean forward time: a point the caller's cost model can fit
            # (the last step's shape against the mean time was not, once other sessions joined some of the steps).
            # forward_ns counts every step, lookup rounds too (they report their own steps).
            n = max(run.plain_steps, 1)
            shape = StepShape(round(run.step_sequences / n), round(run.step_tokens / n), run.forward_ns, run.started_ns)
            timing = self._timing(t0, f0, shape)
            timing.steps = run.steps
        else:
            results = await self._in_order(before, specs, lambda: self.scheduler.batched("verify", specs))
            timing = self._timing(t0, f0, results[0].step if results else None)
            timing.steps = 1
        timing.mask_ns = max(v.grammar_ns([spec.session_id for spec in specs]) - masks0, 0)
        timing.translate_ns = translate_ns
        timing.queue_ns = max(timing.queue_ns - translate_ns, 0)  # translating came first, and is not a wait
        return pb.VerifyResponse(
            results=[
                pb.VerifyResult(
                    session_id=r.session_id,
                    num_accepted=r.num_accepted,
                    tokens=[token_to_pb(t) for t in r.tokens],
                    position=r.position,
                    drafted=len(spec.draft_tokens),
                    lookup_rounds=[
                        pb.LookupRound(
                            offset=lr.offset,
                            match_len=lr.match_len,
                            drafted=lr.drafted,
                            accepted=lr.accepted,
                            forward_ns=lr.step.forward_ns,
                            step_sequences=lr.step.sequences,
                            step_tokens=lr.step.tokens,
                        )
                        for lr in r.lookup_rounds
                    ],
                )
                for r, spec in zip(results, specs, strict=True)
            ],
            timing=timing,
        )

    async def _in_order(
        self, before: set[asyncio.Future], specs: list[VerifySpec], run: Callable[[], Awaitable[T]]
    ) -> T:
        """Run a call after the ones ahead of it for the same sessions, and hold back the calls after it (registered
        before the first await, so the order is the order the calls arrived in).

        Every call registers, one step or several: a one-step call that only waited for the call ahead of it could be
        overtaken. When the call ahead finished just as it arrived, its wake-up took two passes of the event loop,
        and a multi-step call arriving right after it, with nothing left to wait for, reached the scheduler first
        (seen: a lookup round's follow-up, skipped, then a stretch's one-token call and the call pipelined behind it;
        the second ran first and failed on the position)."""
        mine = asyncio.get_running_loop().create_future()
        for spec in specs:
            self._chains[spec.session_id] = mine
        try:
            if before:
                await asyncio.wait(before)  # not gather: a waiter that is cancelled must not cancel what it waits on
            return await run()
        finally:
            mine.set_result(None)
            for spec in specs:
                if self._chains.get(spec.session_id) is mine:
                    del self._chains[spec.session_id]

    async def _plain_chains(self, run: _PlainRun) -> list[VerifyResult]:
        """Several plain tokens per item (`Continuation.plain_steps`), one scheduler step each, so that every step
        still batches with other sessions' calls (an item's first step may verify its drafts: a round that goes on);
        `run` keeps the steps' count and times."""
        return await self.scheduler.batched("verify", run.first(), then=run.then)

    async def VerifyStream(self, requests, context: grpc.aio.ServicerContext):
        async for response in stream_replies(
            requests, self.Verify, pb.VerifyResponse, context, "/tandem.v1.Target/Verify"
        ):
            yield response

    async def Rollback(self, request: pb.RollbackRequest, context: grpc.aio.ServicerContext) -> pb.RollbackResponse:
        v = self._ready()
        t0, f0 = time.perf_counter_ns(), v.engine.forward_ns
        items = [(item.session_id, item.position) for item in request.items]
        await self.scheduler.job(lambda: v.rollback(items))
        return pb.RollbackResponse(timing=self._timing(t0, f0))

    async def Close(self, request: pb.CloseRequest, context: grpc.aio.ServicerContext) -> pb.CloseResponse:
        v = self._ready()
        closed = v.close(list(request.session_ids))  # at once: never waits behind queued engine work
        if closed and self.scheduler is not None:  # the KV is reclaimed before the engine's next step
            task = asyncio.create_task(self.scheduler.job(lambda: None))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return pb.CloseResponse(closed=closed)
