"""gRPC servicer for tandem.v1.Draft: protobuf in, DraftService call on the engine thread, protobuf out."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.draft.service import DraftService, ProposeResult, ProposeSpec
from services.draft.text_sessions import TextPrompt
from tandem import PROTOCOL_VERSION, __version__
from tandem.convert import (
    constraint_from_pb,
    dist_to_pb,
    info_pb,
    sampling_from_pb,
    serving_stats,
    vocabulary_from_pb,
)
from tandem.engine import Engine
from tandem.frames import PROPOSE, FrameMethod
from tandem.grpc_server import FrameOffer, ServiceLoading, stream_replies
from tandem.scheduler import StepScheduler
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tandem.worker import EngineWorker


class DraftServicer(pb_grpc.DraftServicer):
    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.service: DraftService | None = None
        self.engine: Engine | None = None  # None for the model-free n-gram drafter
        self.scheduler: StepScheduler | None = None
        self.frames: FrameOffer | None = None  # set by the service's main when it serves frames (tandem/frames.py)
        self._background: set[asyncio.Task] = set()

    def attach(
        self,
        service: DraftService,
        engine: Engine | None,
        max_batch: int = 64,
        batch_wait_ms: float = 20.0,
        inline_steps: bool = False,
    ) -> None:
        """Start serving: proposals of all sessions waiting at a step run in one batch.

        Single-stream inline: with one active session, or always for a model-free drafter (microseconds a call,
        nothing gained by batching), a Propose runs on the serving thread without a hand-off to the engine thread.
        """
        inline = None
        if inline_steps:
            inline = (lambda _: True) if engine is None else (lambda _: len(service.store) <= 1)
        scheduler = StepScheduler(
            self.worker,
            before_step=service.reclaim,
            max_groups=max_batch,
            max_gather_s=batch_wait_ms / 1e3,
            inline=inline,
        )
        scheduler.register("propose", service.propose_groups)
        self.engine = engine
        self.scheduler = scheduler
        self.service = service

    async def expire_idle(self) -> None:
        if self.service is not None and self.scheduler is not None:
            await self.scheduler.job(self.service.expire_idle)

    def _ready(self) -> DraftService:
        if self.service is None or self.scheduler is None:
            raise ServiceLoading("the draft model is still loading")
        return self.service

    def _forward_ns(self) -> int:
        return self.engine.forward_ns if self.engine is not None else 0

    def _timing(self, t0: int, f0: int) -> pb.Timing:
        return pb.Timing(forward_ns=self._forward_ns() - f0, total_ns=time.perf_counter_ns() - t0)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        service = self._ready()
        if self.engine is not None:
            msg = info_pb(self.engine, drafter=service.drafter.name)
        else:
            msg = pb.InfoResponse(
                model_name="ngram",
                architecture="prompt-lookup",
                backend="CPU",
                device="CPU (model-free)",
                version=f"tandem {__version__}",
                max_sessions=service.store.max_sessions,
                drafter=service.drafter.name,
                protocol_version=PROTOCOL_VERSION,
            )
        msg.capabilities.proposes_after_repeat = service.drafter.proposes_after_repeat
        msg.capabilities.constraints = service.drafter.knows_grammars
        msg.capabilities.drafts_text = service.texts is not None
        msg.frame_port = self.frames.bound if self.frames is not None else 0
        return serving_stats(msg, service.store, self.scheduler, self.engine)

    def frame_methods(self) -> dict[int, FrameMethod]:
        return {PROPOSE: FrameMethod(pb.ProposeRequest, pb.ProposeResponse, self.Propose, "/tandem.v1.Draft/Propose")}

    async def Open(self, request: pb.OpenRequest, context: grpc.aio.ServicerContext) -> pb.OpenResponse:
        service = self._ready()
        t0, f0 = time.perf_counter_ns(), self._forward_ns()
        items = [
            (
                i.session_id,
                list(i.prompt_token_ids),
                sampling_from_pb(i.sampling),
                constraint_from_pb(i),
                TextPrompt(i.prompt_text, i.shared_vocabulary) if i.prompt_text else None,
                tuple(i.draft_types),
            )
            for i in request.items
        ]
        opened = await self.scheduler.job(lambda: service.open_steps(items))
        return pb.OpenResponse(
            results=[pb.OpenResult(session_id=sid, position=pos) for sid, pos in opened],
            timing=self._timing(t0, f0),
        )

    async def Propose(self, request: pb.ProposeRequest, context: grpc.aio.ServicerContext) -> pb.ProposeResponse:
        self._ready()
        t0, f0 = time.perf_counter_ns(), self._forward_ns()
        specs = [
            ProposeSpec(i.session_id, i.position, list(i.append_token_ids), i.max_tokens, i.rewind, i.append_text)
            for i in request.items
        ]
        results = await self.scheduler.batched("propose", specs)
        timing = self._timing(t0, f0)
        timing.translate_ns = sum(r.translate_ns for r in results)
        return pb.ProposeResponse(proposals=[_proposal_pb(r) for r in results], timing=timing)

    async def PutVocabulary(
        self, request: pb.Vocabulary, context: grpc.aio.ServicerContext
    ) -> pb.PutVocabularyResponse:
        """Keep a target's vocabulary for token-level intersection (built off the event loop: ~0.5 s at 262k)."""
        service = self._ready()
        vocabulary = vocabulary_from_pb(request)
        shared = await asyncio.to_thread(service.put_vocabulary, vocabulary)
        return pb.PutVocabularyResponse(shared_tokens=shared)

    async def ProposeStream(self, requests, context: grpc.aio.ServicerContext):
        async for response in stream_replies(
            requests, self.Propose, pb.ProposeResponse, context, "/tandem.v1.Draft/Propose"
        ):
            yield response

    async def Rollback(self, request: pb.RollbackRequest, context: grpc.aio.ServicerContext) -> pb.RollbackResponse:
        service = self._ready()
        t0, f0 = time.perf_counter_ns(), self._forward_ns()
        items = [(i.session_id, i.position) for i in request.items]
        await self.scheduler.job(lambda: service.rollback(items))
        return pb.RollbackResponse(timing=self._timing(t0, f0))

    async def Close(self, request: pb.CloseRequest, context: grpc.aio.ServicerContext) -> pb.CloseResponse:
        service = self._ready()
        closed = service.close(list(request.session_ids))  # at once: never waits behind queued engine work
        if closed:  # the slots are reclaimed before the engine's next step
            task = asyncio.create_task(self.scheduler.job(lambda: None))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return pb.CloseResponse(closed=closed)


def _proposal_pb(result: ProposeResult) -> pb.Proposal:
    msg = pb.Proposal(
        session_id=result.session_id,
        position=result.position,
        token_ids=result.draft.tokens,
        distributions=[dist_to_pb(d) for d in result.draft.dists or ()],
        match_len=result.draft.match_len,
    )
    if result.text is not None:
        msg.text = result.text.text
        msg.context_full = result.text.context_full
    return msg
